"""The notebooks that read as a story: prose in markdown, numbers checked, tables and figures for
the page.

Holds ``STORY_NOTEBOOKS``, in ``notebooks/`` and in the executed reference run ``outputs/cpu/``, to:

- prose in markdown cells only: no code cell builds sentences (``Markdown(...)``, ``print`` of a
  sentence), and the notebook ends with a markdown "What we learned", then the metrics cell;
- every number typed in markdown is a story claim, a config or parameter value, a constant listed
  here with where it comes from, or a figure of the notebook's metrics JSON (``QUOTED``) that it
  equals at the decimals written (the metrics are the reference run's, which fixes them exactly);
- tables: no header row of index labels, one number format per column, the page's width counted
  with the bold header (no prose read as maths: tests/test_readers_view.py);
- figures carry alt text (``plots.show_figure``);
- each notebook's kernelspec and language_info are what the installed kernel reports, so opening one
  in JupyterLab and saving it changes nothing (the save itself is jupyter_server's contents
manager).
"""

import ast
import json
import math
import re
import shutil

import nbformat
import page_width
import pytest

from gemma_nb import decode_roofline, display
from gemma_nb.params import GEMMA4_26B_CONFIG_PATH
from gemma_nb.paths import NOTEBOOKS_DIR, OUTPUTS_DIR
from gemma_nb.story import CLAIMS
from gemma_nb.tools.run import KERNEL_NAME, kernelspec_metadata

STORY_NOTEBOOKS = [
    "01_memory_arithmetic",
    "02_quantization",
    "03_lm_head_sharding",
    "04_compile",
    "05_slim_deploy",
    "06_embedding_scale",
    "07_decode_benchmark",
]
REFERENCE = OUTPUTS_DIR / "cpu"
BOTH = [(folder, name) for name in STORY_NOTEBOOKS for folder in ("notebooks", "outputs")]


def notebook(folder: str, name: str):
    return nbformat.read(
        (NOTEBOOKS_DIR if folder == "notebooks" else REFERENCE) / f"{name}.ipynb", as_version=4
    )


def metrics(name: str) -> dict:
    return json.loads((REFERENCE / "metrics" / f"{name}.json").read_text())["metrics"]


def outputs(name: str):
    for index, cell in enumerate(notebook("outputs", name).cells):
        for output in cell.get("outputs", []):
            yield index, cell, output


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else (value or "")


# Prose lives in markdown
# ------------------------------------------------------------------------------------------------

PROSE_WORDS = 5  # a string of this many words or more, printed or shown as markdown, is a sentence


def _sentences_built_in(source: str) -> list[str]:
    """Calls in a code cell that build prose: Markdown(...), or print/display of a literal
    sentence."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = getattr(node.func, "id", getattr(node.func, "attr", ""))
        if name == "Markdown":
            found.append("Markdown(...)")
        elif name in ("print", "display"):
            words = " ".join(
                part.value
                for arg in node.args
                for part in ast.walk(arg)
                if isinstance(part, ast.Constant) and isinstance(part.value, str)
            ).split()
            if len(words) >= PROSE_WORDS:
                found.append(f"{name}({' '.join(words[:6])} ...)")
    return found


@pytest.mark.parametrize("folder, name", BOTH)
def test_no_code_cell_builds_prose(folder, name):
    built = {
        i: _sentences_built_in(cell.source)
        for i, cell in enumerate(notebook(folder, name).cells)
        if cell.cell_type == "code" and "injected-parameters" not in cell.metadata.get("tags", [])
    }
    built = {i: calls for i, calls in built.items() if calls}
    assert not built, (
        f"{folder}/{name}: code cells that build sentences (write them in markdown): {built}"
    )


@pytest.mark.parametrize("folder, name", BOTH)
def test_the_notebook_ends_with_what_we_learned_in_markdown(folder, name):
    cells = notebook(folder, name).cells
    learned = [
        i
        for i, c in enumerate(cells)
        if c.cell_type == "markdown" and c.source.startswith("## What we learned")
    ]
    assert len(learned) == 1, (
        f"{folder}/{name}: one markdown cell opening with '## What we learned'"
    )
    body = cells[learned[0]].source.split("\n", 1)[1].strip()
    assert len(body.split()) >= 50, (
        f"{folder}/{name}: 'What we learned' says what was learned, in its own cell"
    )
    after = cells[learned[0] + 1 :]
    neuron = [
        c
        for c in after[1:]
        if c.source.startswith('if target == "neuron":') and "save_metrics(" in c.source
    ]
    assert (
        after
        and after[0].cell_type == "code"
        and "save_metrics(" in after[0].source
        and len(after) == 1 + len(neuron) <= 2
    ), (
        f"{folder}/{name}: after 'What we learned' only the cell that writes and "
        "shows the metrics (and the neuron target's own)"
    )


@pytest.mark.parametrize(
    "path", sorted(NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb")), ids=lambda p: p.stem
)
def test_papermill_reads_every_parameter_without_a_warning(path, caplog):
    """papermill's inspection (``papermill --help-notebook``) skips, with a warning, a line it
    cannot parse."""
    from papermill.translators import PythonTranslator

    cell = next(
        c
        for c in nbformat.read(path, as_version=4).cells
        if "parameters" in c.metadata.get("tags", [])
    )
    with caplog.at_level("WARNING", logger="papermill"):
        names = [parameter.name for parameter in PythonTranslator.inspect(cell)]
    assert not caplog.records, [record.getMessage() for record in caplog.records]
    assigned = [
        node.targets[0].id for node in ast.parse(cell.source).body if isinstance(node, ast.Assign)
    ]
    assert names == assigned, f"{path.stem}: papermill reads {names}, the cell assigns {assigned}"


# Every number typed in markdown is checked
# ------------------------------------------------------------------------------------------------

GB, GiB = 1e9, 2**30
# Figures of the metrics JSON the prose quotes, as the prose writes them (rounded to its decimals).
QUOTED = {
    "01_memory_arithmetic": {
        "parameters": lambda m: sum(m["params_by_group"].values()),
        "total, B": lambda m: m["total_params_b"],
        "active, B": lambda m: m["active_params_b"],
        "active without the table, B": lambda m: m["active_params_port_card_b"],
        "experts' share of non-embedding weights": lambda m: m["experts_share_pct"],
        "experts' share of all weights": lambda m: m["experts_share_all_weights_pct"],
        "fp32 scales per rank, GB": lambda m: (
            m["experts_int8_gb_per_rank"] - m["params_by_group"]["experts"] // 2 / GB
        ),
        "bf16 experts per rank": lambda m: m["experts_bf16_gb_per_rank"],
        "int8 experts per rank": lambda m: m["experts_int8_gb_per_rank"],
        "non-expert HBM per rank": lambda m: m["int8_experts_non_expert_gb"],
        "replicated bf16 lm_head": lambda m: m["int8_experts_gb_per_rank_by_group"]["lm_head"],
        "int8_experts total": lambda m: m["gb_per_rank_by_scheme"]["int8_experts"],
        "int8_squeeze total": lambda m: m["gb_per_rank_by_scheme"]["int8_squeeze"],
        "spare against 16 GB": lambda m: -m["int8_experts_gap_gb"],
        "spare against 16 GiB": lambda m: (
            -m["allowance_window_gb"]["spec"]["failing_static_gb"]
            - m["runtime_allowance_default_gb"]
            + m["hbm_per_core_gb"]
        ),
        "16 GiB in GB": lambda m: m["hbm_per_core_gb"],
        "min to fail": lambda m: m["allowance_window_gb"]["spec"]["min_to_fail_gb"],
        "max to fit": lambda m: m["allowance_window_gb"]["spec"]["max_to_fit_gb"],
        "min to fail / floor": lambda m: (
            m["allowance_window_gb"]["spec"]["min_to_fail_gb"] / m["runtime_allowance_default_gb"]
        ),
        "max to fit / floor": lambda m: (
            m["allowance_window_gb"]["spec"]["max_to_fit_gb"] / m["runtime_allowance_default_gb"]
        ),
        "runtime floor": lambda m: m["runtime_allowance_default_gb"],
        "allowance if short by 3.5 GB": lambda m: m["allowance_window_gb"]["spec"][
            "allowance_if_short_by_gb"
        ],
        "squeeze overflow then": lambda m: m["allowance_window_gb"]["spec"][
            "fitting_overflow_then_gb"
        ],
        "squeeze releases": lambda m: (
            m["gb_per_rank_by_scheme"]["int8_experts"] - m["gb_per_rank_by_scheme"]["int8_squeeze"]
        ),
        "lm_head int8 shard": lambda m: m["lm_head_int8_sharded_gb_per_rank"],
        "lm_head released": lambda m: m["lm_head_released_gb_per_rank"],
        "shared MLP saving": lambda m: m["shared_mlp_int8_saving_gb_per_rank"],
        "residency, GB": lambda m: m["final_residency_gb_per_rank"],
        "residency, GiB": lambda m: m["final_residency_gb_per_rank"] * GB / GiB,
        "KV bytes per token per rank": lambda m: m["kv_cache_bytes_per_token_per_rank"],
        "mxfp4 headroom": lambda m: m["headroom_gb_by_instance"]["inf2.xlarge"]["mxfp4_experts"],
    },
    "02_quantization": {
        "MXFP4 share of bf16 experts, %": lambda m: (
            100
            * m["experts_gb_per_rank_by_scheme"]["mxfp4_experts"]
            / m["experts_gb_per_rank_by_scheme"]["bf16"]
        ),
        "NVFP4 share of bf16 experts, %": lambda m: (
            100
            * m["experts_gb_per_rank_by_scheme"]["nvfp4_experts"]
            / m["experts_gb_per_rank_by_scheme"]["bf16"]
        ),
        "int8 share of bf16 experts, %": lambda m: (
            100
            * m["experts_gb_per_rank_by_scheme"]["int8_experts"]
            / m["experts_gb_per_rank_by_scheme"]["bf16"]
        ),
        "NVFP4 over MXFP4, %": lambda m: (
            100
            * (
                m["experts_gb_per_rank_by_scheme"]["nvfp4_experts"]
                / m["experts_gb_per_rank_by_scheme"]["mxfp4_experts"]
                - 1
            )
        ),
        "most headroom of 16 GiB": lambda m: max(
            16 * GiB / GB - gb for gb in m["gb_per_rank_by_scheme"].values()
        ),
        "MXFP4 saving over int8 experts, GB": lambda m: (
            m["experts_gb_per_rank_by_scheme"]["int8_experts"]
            - m["experts_gb_per_rank_by_scheme"]["mxfp4_experts"]
        ),
        "NVFP4 saving over int8 experts, GB": lambda m: (
            m["experts_gb_per_rank_by_scheme"]["int8_experts"]
            - m["experts_gb_per_rank_by_scheme"]["nvfp4_experts"]
        ),
        "26B vocabulary": lambda m: m["vocab_size_26b"],
        "checkpoint vocabulary": lambda m: m["checkpoint_vocab_size"],
        "vocabulary ratio": lambda m: m["vocab_size_26b"] / m["checkpoint_vocab_size"],
    },
    "03_lm_head_sharding": {
        "replicated bf16 head, GB": lambda m: m["replicated_bf16_bytes_per_rank"] / GB,
        "int8 shard, GB": lambda m: m["int8_shard_bytes_per_rank"] / GB,
        "released, GB": lambda m: m["released_bytes_per_rank"] / GB,
        "host table, bytes": lambda m: m["host_embedding_bytes"],
        "host table, GB": lambda m: m["host_embedding_bytes"] / GB,
        "rows per rank": lambda m: m["shard_rows_per_rank"],
        "shard int8 bytes": lambda m: m["int8_shard_weight_bytes_per_rank"],
        "shard scale bytes": lambda m: m["int8_shard_scale_bytes_per_rank"],
        "shard bytes": lambda m: m["int8_shard_bytes_per_rank"],
        "shard / replicated, %": lambda m: (
            100 * m["int8_shard_bytes_per_rank"] / m["replicated_bf16_bytes_per_rank"]
        ),
        "full-size positions": lambda m: m["full_size_positions"],
        "int8 head's top-1 = bf16 head's, %": lambda m: 100 * m["checkpoint_top1_vs_bf16"],
    },
    "04_compile": {
        "26B parameters": lambda m: m["extrapolated_26b"]["params"],
        "26B bf16 weights, GB": lambda m: 2 * m["extrapolated_26b"]["params"] / GB,
        "port's peak over the bf16 weights": lambda m: (
            180 / (2 * m["extrapolated_26b"]["params"] / GB)
        ),
        "port's compile on the inf2.8xlarge, USD": lambda m: _box(m, "inf2.8xlarge"),
        "port's compile on the inf2.24xlarge, USD": lambda m: _box(m, "inf2.24xlarge"),
        "inf2.8xlarge / inf2.24xlarge, USD": lambda m: (
            _box(m, "inf2.8xlarge") / _box(m, "inf2.24xlarge")
        ),
        "gathers the sparse decode adds": lambda m: (
            _graph(m, "decode", "sparse")["gathers"] - _graph(m, "decode", "dense")["gathers"]
        ),
    },
    "05_slim_deploy": {
        "naive 26B host, GB": lambda m: m["host_budget_26b_gb"]["naive: model in fp32"],
        "inf2.xlarge host RAM, GB": lambda m: m["inf2_xlarge_host_ram_gb"],
        "naive 26B / inf2.xlarge host RAM": lambda m: (
            m["host_budget_26b_gb"]["naive: model in fp32"] / m["inf2_xlarge_host_ram_gb"]
        ),
        "slim / naive RSS target": lambda m: m["targets"][0]["at_most"],
        "exported / eager decode target": lambda m: m["targets"][1]["at_most"],
        "router choices compared": lambda m: m["tp2_emulation"]["router_choices"],
        "router top-k equal, fp32 softmax": lambda m: m["tp2_emulation"]["router_topk_equal_bf16"],
        "router top-k equal, bf16 softmax": lambda m: m["tp2_emulation"][
            "router_topk_equal_bf16_autocast_all"
        ],
    },
    "06_embedding_scale": {
        "buffer at hidden 128": lambda m: m["scales"]["float32"]["embed_scale buffer"],
        "applied in bf16 at hidden 128": lambda m: m["scales"]["bfloat16"][
            "applied (cast to the weight dtype)"
        ],
        "unscaled norm ratio, trained": lambda m: m["paths"]["float32/unscaled"]["norm_ratio"],
        "unscaled fact recall, %": lambda m: 100 * m["paths"]["bfloat16/unscaled"]["fact_recall"],
        "reference fact recall, %": lambda m: (
            100 * m["paths"]["bfloat16/reference (input_ids)"]["fact_recall"]
        ),
        "math_sqrt elements off, trained, %": lambda m: m["paths"]["bfloat16/math_sqrt"][
            "differ_pct"
        ],
        "facts scored": lambda m: m["facts_scored"],
        "facts": lambda m: m["facts"],
        "bf16 scale at 2816": lambda m: m["wide"]["rounding"]["bfloat16"]["scale_in_dtype"],
        "ulps below": lambda m: -m["wide"]["rounding"]["bfloat16"]["rounding_error_ulps"],
        "float32 buffer at 2816": lambda m: m["wide"]["rounding"]["bfloat16"]["scale_float32"],
        "sqrt(2816)": lambda m: m["wide"]["rounding"]["bfloat16"]["sqrt_exact"],
        "unscaled norm ratio at 2816, bf16": lambda m: m["wide"]["paths"]["bfloat16/unscaled"][
            "norm_ratio"
        ],
        "unscaled norm ratio at 2816, fp32": lambda m: m["wide"]["paths"]["float32/unscaled"][
            "norm_ratio"
        ],
        "math_sqrt elements off at 2816, %": lambda m: m["wide"]["paths"]["bfloat16/math_sqrt"][
            "differ_pct"
        ],
        "fp32 table at 2816, MB": lambda m: (
            m["wide"]["vocab_size"] * m["wide"]["hidden_size"] * 4 / 1e6
        ),
    },
    "07_decode_benchmark": {
        "distinct experts at B = 64, real router": lambda m: _distinct(m, "64")["real_full_size"],
        "distinct experts at B = 64, formula": lambda m: _distinct(m, "64")["formula_full_size"],
        "DenseExperts roofline, tok/s": lambda m: m["inf2_dense_tok_s"],
        "DenseExperts roofline / the port": lambda m: (
            m["inf2_dense_tok_s"] / m["inf2_measured_tok_s"]
        ),
        "sparse / DenseExperts roofline": lambda m: m["inf2_sparse_tok_s"] / m["inf2_dense_tok_s"],
        "sparse roofline, tok/s": lambda m: m["inf2_sparse_tok_s"],
        "upcast hypothesis, tok/s": lambda m: m["inf2_upcast_tok_s"],
        "upcast hypothesis / the port": lambda m: m["inf2_upcast_tok_s"] / m["inf2_measured_tok_s"],
        "compute-bound / the port": lambda m: (
            m["inf2_compute_bound_tok_s"] / m["inf2_measured_tok_s"]
        ),
        "USD/M at the port's speed": lambda m: m["inf2_measured_usd_per_m_tokens"],
        "no cache: dense, sparse tok/s": lambda m: (
            m["kv_sensitivity"][0]["dense_tok_s"],
            m["kv_sensitivity"][0]["sparse_tok_s"],
        ),
        "at 512 tokens: dense tok/s": lambda m: _context(m, 512)["dense_tok_s"],
        "at 512 tokens: cache GB per token": lambda m: _context(m, 512)["kv_gb_per_token"],
        "sparse roofline lost to the cache at 512, %": lambda m: (
            100 * (1 - _context(m, 512)["sparse_tok_s"] / m["kv_sensitivity"][0]["sparse_tok_s"])
        ),
        "longest context": lambda m: m["kv_sensitivity"][-1]["context_len"],
        "sparse roofline lost at the longest context, %": lambda m: (
            100
            * (1 - m["kv_sensitivity"][-1]["sparse_tok_s"] / m["kv_sensitivity"][0]["sparse_tok_s"])
        ),
        "inf2 streams if the runtime takes the least": lambda m: _inf2(m)["largest_batch_if_low"],
        "expert reads at that batch": lambda m: 8 * _inf2(m)["largest_batch_if_low"],
        "distinct experts at that batch": lambda m: decode_roofline.expected_distinct_experts(
            128, 8, _inf2(m)["largest_batch_if_low"]
        ),
        **{
            f"{path} {key}": (lambda m, path=path, key=key: _inf2(m)["paths"][path][key])
            for path, key in (
                ("sparse", "usd_per_m_b1"),
                ("dense", "usd_per_m_b1"),
                ("sparse", "usd_per_m_if_low"),
                ("dense", "usd_per_m_if_low"),
                ("nxd_rule", "usd_per_m_if_low"),
                ("sparse", "tok_s_if_low"),
            )
        },
        "sparse tok/s per stream at that batch": lambda m: (
            _inf2(m)["paths"]["sparse"]["tok_s_if_low"] / _inf2(m)["largest_batch_if_low"]
        ),
    },
}


def _box(m, instance):
    """What the port's 40-minute compile costs on ``instance`` (notebook 04's box table)."""
    row = next(r for r in m["compile_boxes_port"] if r["instance"] == instance)
    return next(v for k, v in row.items() if k.startswith("usd "))


def _graph(m, graph, experts, tp=2):
    return next(
        r for r in m["xla_lowering"] if (r["graph"], r["experts"], r["tp"]) == (graph, experts, tp)
    )


def _context(m, tokens):
    return next(r for r in m["kv_sensitivity"] if r["context_len"] == tokens)


def _distinct(m, batch):
    return m["batch"]["distinct_experts"][batch]


def _inf2(m):
    return m["batch_roofline"]["inf2.xlarge, int8 squeeze, TP=2"]


# Numbers the prose types that are neither computed nor a claim, config or parameter value.
CONSTANTS = {
    "all": {"26": "the model's name, Gemma-4-26B-A4B", "1,000": "the page, ~1,000 px"},
    "01_memory_arithmetic": {
        "96": "Neuron docs: 96 MB of micro-code per NeuronCore",
        "512": "Neuron docs: scratchpad pages of 512 MB (also the shipped context)",
    },
    "02_quantization": {
        "0.5": "E2M1 values",
        "1.5": "E2M1 values",
        "127": "int8's absmax/127",
        "448": "OCP e4m3's largest value",
        "240": "Neuron's e4m3's largest value",
        "32": "MXFP4's block",
        "16": "NVFP4's block",
        "1408": "2 x 704, the fused gate_up width",
        "0.02": "the random layer's N(0, 0.02)",
        "50": "peak_rss's 50 ms sampling",
        "0.19": "neuronx-distributed 0.19",
        "2.31": "Neuron SDK 2.31",
    },
    "03_lm_head_sharding": {
        "64": "shards start at multiples of 64 rows",
        "4096": "seeded_rows' block",
        "127.0.0.1": "loopback",
        "0.19": "neuronx-distributed 0.19",
        "2.31": "Neuron SDK 2.31",
    },
    "04_compile": {
        "100": "the port's 100 GB of swap",
        "50": "hostmem's 50 ms sampling",
        "2.31": "Neuron SDK 2.31",
        "2.9": "torch-neuronx and torch-xla 2.9",
        "0.18": "neuronx-distributed 0.18",
        "64": "lowering.TOLERANCE_ULPS, fp32",
        "32": "lowering.TOLERANCE_ULPS, bf16",
    },
    "05_slim_deploy": {
        "20": "hostmem's 20 ms sampling",
        "2.31": "Neuron SDK 2.31",
        "0.18": "neuronx-distributed 0.18",
        "0.19": "neuronx-distributed 0.19",
    },
    "07_decode_benchmark": {
        "1.5": "the bandwidth-floor target",
        "12": "the sparse-vs-dense target",
        "0.65": "the int8-vs-bf16 target",
        "820": "Inferentia2's 820 GiB/s",
        "118": "NxD Inference's ~117.5 tok/s, rounded",
        "8080": "the port's server port",
        "200": "distinct_table's draws",
    },
    "06_embedding_scale": {
        "5.24": "transformers 5.24",
        "11.313708": "sqrt(128) as float32",
        "256": "the self-check's probe ids",
        "0.25": "bf16's spacing between 32 and 64",
        "32": "bf16's spacing between 32 and 64",
        "64": "bf16's spacing between 32 and 64",
    },
}
NUMBER = re.compile(r"[-−±~≈]?(\d[\d,]*(?:\.\d+)?)(?:%|x|B|GB|GiB|MB|MiB|s|ms)?")


def _known_numbers(name: str) -> set[float]:
    known = set(range(11))
    for claim in CLAIMS.values():
        known |= {claim.value, *claim.within}
    config = json.loads(GEMMA4_26B_CONFIG_PATH.read_text())
    known |= {v for v in config.values() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    for cell in notebook("notebooks", name).cells:
        if "parameters" in cell.metadata.get("tags", []):
            known |= {
                node.value
                for node in ast.walk(ast.parse(cell.source))
                if isinstance(node, ast.Constant) and isinstance(node.value, (int, float))
            }
    return {float(v) for v in known}


def markdown_numbers(source: str) -> list[str]:
    """The numbers a markdown cell types, as written: outside code spans, split at -, / and ×."""
    prose = re.sub(r"`[^`]*`", " ", source)
    words = re.split(r"[\s|/×();:*\"“”']+|,(?!\d{3})|(?<=\d)[-–](?=\d)", prose)
    found = []
    for word in words:
        word = word.strip(".!?[]")
        if (match := NUMBER.fullmatch(word)) and not re.search(r"[A-Za-z]\d|\d-[A-Za-z]", word):
            found.append(match.group(1))
    return found


def _matches(written: str, value: float) -> bool:
    decimals = len(written.split(".")[1]) if "." in written else 0
    return math.isclose(
        round(float(value), decimals), float(written.replace(",", "")), abs_tol=1e-9
    )


@pytest.mark.parametrize("name", STORY_NOTEBOOKS)
def test_every_number_typed_in_markdown_is_checked(name):
    known, constants = _known_numbers(name), {**CONSTANTS["all"], **CONSTANTS.get(name, {})}
    quoted = {label: extract(metrics(name)) for label, extract in QUOTED.get(name, {}).items()}
    unexplained, used = [], set()
    for index, cell in enumerate(notebook("notebooks", name).cells):
        if cell.cell_type != "markdown":
            continue
        for written in markdown_numbers(cell.source):
            hits = [
                label
                for label, value in quoted.items()
                if any(
                    _matches(written, v) for v in (value if isinstance(value, tuple) else (value,))
                )
            ]
            used.update(hits)
            if (
                not hits
                and written not in constants
                and float(written.replace(",", "")) not in known
            ):
                unexplained.append(f"cell {index}: {written}")
    assert not unexplained, (
        f"{name}: numbers typed in markdown that are no metric of the notebook (QUOTED), no "
        f"claim, config or parameter value and no listed constant: {unexplained}"
    )
    assert used == set(quoted), (
        f"{name}: QUOTED figures the prose no longer quotes: {sorted(set(quoted) - used)}"
    )


def test_the_number_reader_reads_prose_not_names():
    text = (
        "Gemma-4-26B-A4B on an inf2.xlarge: 25,233,141,760 parameters, 3-4 GB short, 1.48 / 0.37 "
        "GB, `int8_experts` at 93.24% and 3.823B, not bf16 or top-8 (`math.sqrt(2816)` in code), "
        "USD 1.31."
    )
    assert markdown_numbers(text) == [
        "25,233,141,760",
        "3",
        "4",
        "1.48",
        "0.37",
        "93.24",
        "3.823",
        "1.31",
    ]


# Tables and figures for the page; dollars
# ------------------------------------------------------------------------------------------------


def _tables(name):
    for index, _, output in outputs(name):
        for header, body in page_width.html_table_parts(
            _text(output.get("data", {}).get("text/html"))
        ):
            yield index, header, body


@pytest.mark.parametrize("name", STORY_NOTEBOOKS)
def test_tables_have_one_header_row_one_format_per_column_and_fit_with_a_bold_header(name):
    problems = []
    for index, header, body in _tables(name):
        if page_width.index_label_rows(header):
            problems.append(
                f"cell {index}: a header row of index labels {page_width.index_label_rows(header)}"
            )
        for column, formats in page_width.mixed_format_columns(body).items():
            problems.append(
                f"cell {index}: column {(header[-1] + [''] * column)[column]!r} mixes "
                f"{sorted(formats)}"
            )
        width = page_width.table_width_px(header + body, header_rows=len(header))
        if width > display.PAGE_WIDTH_PX:
            problems.append(f"cell {index}: ~{width:.0f} px wide with its bold header")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", STORY_NOTEBOOKS)
def test_every_figure_has_alt_text(name):
    """In the output's image/png metadata, where nbconvert's classic HTML template (and nbsphinx)
    read it; its default lab template and JupyterLab 4.6 do not read any alt text of an output
    image."""
    from nbconvert import HTMLExporter

    missing = [
        index
        for index, _, output in outputs(name)
        if "image/png" in output.get("data", {})
        and not output.get("metadata", {}).get("image/png", {}).get("alt", "").strip()
    ]
    assert not missing, (
        f"{name}: figures without alt text in cells {missing}: show them with plots.show_figure"
    )
    page, _ = HTMLExporter(template_name="classic").from_notebook_node(notebook("outputs", name))
    images = re.findall(r"<img\b[^>]*>", page)
    assert images and all(
        re.search(r'alt="[^"]{20,}"', image) and "No description" not in image for image in images
    )


# Opening a notebook in JupyterLab and saving it changes nothing
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kernel_language_info():
    """What the installed kernel reports, which JupyterLab writes into a notebook it opens."""
    from jupyter_client.manager import start_new_kernel

    manager, client = start_new_kernel(kernel_name=KERNEL_NAME)
    try:
        return client.kernel_info(reply=True, timeout=60)["content"]["language_info"]
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


@pytest.mark.parametrize("folder, name", BOTH)
def test_the_notebook_carries_the_installed_kernels_metadata(folder, name, kernel_language_info):
    metadata = notebook(folder, name).metadata
    assert metadata["kernelspec"] == kernelspec_metadata(), f"{folder}/{name}: kernelspec"
    assert metadata["language_info"] == kernel_language_info, f"{folder}/{name}: language_info"


@pytest.mark.parametrize("folder, name", BOTH)
def test_saving_a_notebook_unedited_rewrites_nothing(folder, name, tmp_path, monkeypatch):
    """jupyter_server's contents manager, which JupyterLab saves through, writes the same bytes
    back."""
    from jupyter_server.services.contents.filemanager import FileContentsManager

    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "data"))  # its notary signs what it saves

    source = (NOTEBOOKS_DIR if folder == "notebooks" else REFERENCE) / f"{name}.ipynb"
    shutil.copy(source, tmp_path / source.name)
    manager = FileContentsManager(root_dir=str(tmp_path))
    model = manager.get(source.name, content=True, type="notebook")
    manager.save({"type": "notebook", "format": "json", "content": model["content"]}, source.name)
    assert (tmp_path / source.name).read_bytes() == source.read_bytes()
