"""The port's slim deploy (notebooks 05, 07, the server) from the artifact folder alone: graphs,
host embedding, greedy loop."""

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from gemma_nb.embedding import host_embedding_for
from gemma_nb.modelio import model_skeleton
from gemma_nb.neuron.build import sdk_label, step_inputs
from gemma_nb.neuron.build_folder import HOST_EMBEDDING_FILE, MODEL_FILE, read_artifact
from gemma_nb.neuron.expert_mlps import import_nxd


@dataclass
class NeuronStepRunner:
    """Greedy decoding over a compiled graph pair keeping its KV cache as device state; ``embed``:
    ids -> embeddings."""

    graph: Callable
    embed: Callable[[torch.Tensor], torch.Tensor]
    config: object
    max_len: int
    bucket: int
    pad_token_id: int = 0

    def step(self, ids: torch.Tensor, positions: list[int], last_index: int) -> torch.Tensor:
        """One graph call for ``ids`` [1, S] at ``positions``: fp32 logits [1, V] of ``last_index``,
        cut and softcapped here."""
        inputs = step_inputs(
            self.embed(ids), positions, self.max_len, self.config.sliding_window, last_index
        )
        logits = self.graph(*inputs)[:, -1, : self.config.vocab_size].float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @torch.inference_mode()
    def generate(
        self, input_ids, max_new_tokens: int, eos_token_id: int | None = None
    ) -> torch.Tensor:
        ids = torch.atleast_2d(torch.as_tensor(input_ids, dtype=torch.long))
        prompt = ids.shape[1]
        if prompt > self.bucket:
            raise ValueError(
                f"prompt of {prompt} tokens exceeds the compiled prefill bucket of {self.bucket}"
            )
        if prompt + max_new_tokens - 1 > self.max_len:
            raise ValueError(
                f"{prompt} + {max_new_tokens} tokens exceed the compiled KV cache of {self.max_len}"
            )
        padded = torch.nn.functional.pad(ids, (0, self.bucket - prompt), value=self.pad_token_id)
        # the prefill, then a decode per token: the padding's slots are rewritten before the masks
        # open them to a query
        inputs, tokens = (padded, list(range(self.bucket)), prompt - 1), []
        while len(tokens) < max_new_tokens and eos_token_id not in tokens[-1:]:
            tokens.append(int(self.step(*inputs).argmax(-1)))
            inputs = (torch.tensor([[tokens[-1]]]), [prompt + len(tokens) - 1], 0)
        return torch.cat([ids, torch.tensor([tokens], dtype=torch.long)], dim=1)


def load_artifact(artifact_dir: str | Path):
    """``torch.jit.load`` the artifact, its weights put on the NeuronCores: the graph callable
    (``.model``, ``.sdk``)."""
    # registers neuron::SPMDModel for jit.load (transformers-5 workaround applied if needed)
    sdk = import_nxd()
    model = torch.jit.load(str(Path(artifact_dir) / MODEL_FILE))
    model.nxd_model.initialize_with_saved_weights(torch.tensor([0], dtype=torch.int32))

    def graph(*inputs):
        out = model(*inputs)
        return out[0] if isinstance(out, (tuple, list)) else out

    graph.model = model
    graph.sdk = sdk_label(sdk)
    return graph


def slim_deploy(artifact_dir: str | Path) -> tuple[NeuronStepRunner, dict]:
    """(runner, figures) of a validated artifact, ``load_artifact`` timed (its process's host peak
    is measured by whoever started it: ``runs.deploy_each``)."""
    artifact = read_artifact(artifact_dir)
    config, embedding_path = artifact.config, artifact.folder / HOST_EMBEDDING_FILE
    start = time.perf_counter()
    host = host_embedding_for(model_skeleton(config), embedding_path)
    embedding_load_s = time.perf_counter() - start
    start = time.perf_counter()
    graph = load_artifact(artifact.folder)
    neff_load_s = time.perf_counter() - start
    runner = NeuronStepRunner(
        graph, host, config, artifact.max_len, artifact.bucket, config.pad_token_id or 0
    )
    figures = {
        "neff_load_s": neff_load_s,
        "embedding_load_s": embedding_load_s,
        "decode_graph": artifact.decode_graph,
        "sdk": getattr(graph, "sdk", artifact.record.get("sdk", "Neuron SDK")),
    }
    return runner, figures


def until_eos(tokens: list, eos_token_id: int | None) -> list:
    return tokens[: tokens.index(eos_token_id)] if eos_token_id in tokens else tokens
