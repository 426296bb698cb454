"""Train the bundled checkpoint (``python -m gemma_nb.tiny train``): AdamW on every corpus sentence
until full recall; deterministic for a fixed seed on one thread (a rerun reproduces
model.safetensors byte for byte)."""

import json
import math
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from torch.nn.utils.rnn import pad_sequence
from transformers import GenerationConfig

from gemma_nb.evaluate import fact_recall
from gemma_nb.tiny import CHECKPOINT_DIR, DIMS, random_gemma4_config, random_gemma4_model
from gemma_nb.tiny.corpus import EOS, FACTS, build_tokenizer

# transformers' grouped_mm is the fastest experts implementation for a training step here; the saved
# config keeps the default.
TRAIN_EXPERTS_IMPLEMENTATION = "grouped_mm"
INDEX_FILE = "model.safetensors.index.json"


@dataclass
class TrainArgs:
    seed: int = 0
    max_epochs: int = 200
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 100
    weight_decay: float = 0.0
    eval_every_epochs: int = 5
    balance_loss_weight: float = 0.01
    target_recall: float = 1.0
    threads: int = 1
    dims: str = "tiny"  # a key of gemma_nb.tiny.DIMS: "tiny" (the bundled checkpoint) or "tp2"


class RouterBalance:
    """Switch-Transformer load-balancing loss over every layer's router (1.0 when balanced), so all
    experts carry facts."""

    def __init__(self, model):
        self.outputs = []
        self.handles = [
            layer.router.register_forward_hook(lambda _m, _i, output: self.outputs.append(output))
            for layer in model.model.layers
        ]

    def loss(self) -> torch.Tensor:
        total = 0.0
        for probabilities, _, top_k_index in self.outputs:
            experts = probabilities.shape[-1]
            routed = torch.zeros(experts).index_add(
                0, top_k_index.reshape(-1), torch.ones(top_k_index.numel())
            )
            total = total + experts * (routed / top_k_index.numel() * probabilities.mean(0)).sum()
        self.outputs.clear()
        return total / max(1, len(self.handles))

    def peak_load(self) -> float:
        """Busiest expert's share of routed pairs, relative to a perfectly even share (1.0)."""
        return max(
            (
                float(torch.bincount(index.reshape(-1), minlength=probs.shape[-1]).max())
                * probs.shape[-1]
                / index.numel()
                for probs, _, index in self.outputs
            ),
            default=float("nan"),
        )


def _lr_at(step: int, total_steps: int, args: TrainArgs) -> float:
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, total_steps - args.warmup_steps)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train(args: TrainArgs, out_dir: Path = CHECKPOINT_DIR, log=print) -> dict:
    """Train, save the checkpoint (fp32 safetensors + tokenizer) into ``out_dir``, return a summary;
    torch state restored."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    started, out_dir = time.perf_counter(), Path(out_dir)
    try:
        torch.set_num_threads(args.threads)
        torch.use_deterministic_algorithms(True)
        tokenizer = build_tokenizer()
        config = random_gemma4_config(
            **DIMS[args.dims],
            vocab_size=len(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.bos_token_id,
        )
        model = random_gemma4_model(config, seed=args.seed, dtype=torch.float32)
        model.set_experts_implementation(TRAIN_EXPERTS_IMPLEMENTATION)
        epoch, step, epoch_loss, recall, history = _fit(model, tokenizer, args, log, started)
        model.eval()
        model.set_experts_implementation(None)  # back to transformers' default in the saved config
        model.generation_config = GenerationConfig(
            bos_token_id=config.bos_token_id,
            eos_token_id=config.eos_token_id,
            pad_token_id=config.pad_token_id,
            do_sample=False,
        )
        out_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out_dir, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
        summary = {
            "command": " ".join(
                [
                    "python -m gemma_nb.tiny train",
                    *([shlex.join(sys.argv[2:])] if sys.argv[2:] else []),
                ]
            ),
            "args": asdict(args),
            "epochs_run": epoch,
            "steps_run": step,
            "final_loss": round(epoch_loss, 4),
            "final_recall_fp32": round(recall, 4),
            "facts": len(FACTS),
            "vocab_size": config.vocab_size,
            "parameters": sum(p.numel() for p in model.parameters()),
            "train_seconds": round(time.perf_counter() - started, 1),
            "experts_implementation_during_training": TRAIN_EXPERTS_IMPLEMENTATION,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "history": history,
        }
        (out_dir / "training_args.json").write_text(json.dumps(summary, indent=2) + "\n")
        # the neuron smoke run's checkpoint: stored the way the hub stores the 26B
        if args.dims == "tp2":
            save_hub_layout(out_dir)
        return summary
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def _fit(model, tokenizer, args: TrainArgs, log, started: float):
    """AdamW plus the router-balance loss until ``args.target_recall``: (epochs, steps, last loss,
    recall, history)."""
    # (input_ids, labels) [N, S]: every fact sentence + <eos>, right-padded (no mask needed under a
    # causal one)
    rows = [
        torch.tensor(tokenizer(f.sentence).input_ids + [tokenizer.convert_tokens_to_ids(EOS)])
        for f in FACTS
    ]
    input_ids, labels = (
        pad_sequence(rows, batch_first=True, padding_value=value)
        for value in (tokenizer.pad_token_id, -100)
    )
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.98)
    )
    balance = RouterBalance(model)
    shuffle = torch.Generator().manual_seed(args.seed)
    batches_per_epoch = math.ceil(len(input_ids) / args.batch_size)
    total_steps = args.max_epochs * batches_per_epoch
    recall, step, epoch, history = 0.0, 0, 0, []
    for epoch in range(1, args.max_epochs + 1):
        model.train()
        epoch_loss = 0.0
        for rows in torch.randperm(len(input_ids), generator=shuffle).split(args.batch_size):
            for group in optimizer.param_groups:
                group["lr"] = _lr_at(step, total_steps, args)
            loss = model(input_ids=input_ids[rows], labels=labels[rows], use_cache=False).loss
            peak_load = balance.peak_load()
            optimizer.zero_grad(set_to_none=True)
            (loss + args.balance_loss_weight * balance.loss()).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step += 1
            epoch_loss += loss.item() / batches_per_epoch
        if epoch % args.eval_every_epochs == 0 or epoch == args.max_epochs:
            model.eval()
            recall, _ = fact_recall(model, tokenizer, FACTS)
            balance.outputs.clear()
            history.append(
                {
                    "epoch": epoch,
                    "step": step,
                    "loss": round(epoch_loss, 4),
                    "recall": round(recall, 4),
                }
            )
            log(
                f"epoch {epoch:4d}  step {step:5d}  loss {epoch_loss:.4f}  recall {recall:.3f}  "
                f"peak load {peak_load:.1f}x  {time.perf_counter() - started:.0f} s"
            )
            if recall >= args.target_recall:
                break
    for handle in balance.handles:
        handle.remove()
    return epoch, step, epoch_loss, recall, history


def save_hub_layout(folder: str | Path, shards: int = 2) -> dict:
    """The TP=2 checkpoint, weights unchanged, as the hub stores Gemma-4-26B-A4B-it (for the 26B's
    own loader): rewrite ``folder``'s ``model.safetensors`` and ``config.json`` in place as the hub
    lays them out; returns the index."""
    folder = Path(folder)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        assert all(key.startswith("model.") for key in handle.keys()), "tensors not under model."
        tensors = {
            "model.language_model." + key.removeprefix("model."): handle.get_tensor(key)
            for key in handle.keys()
        }
        metadata = handle.metadata() or {}
    text_config = json.loads((folder / "config.json").read_text())
    names = sorted(tensors)
    files = [f"model-{n + 1:05d}-of-{shards:05d}.safetensors" for n in range(shards)]
    weight_map = {name: files[i * shards // len(names)] for i, name in enumerate(names)}
    for file in files:
        save_file(
            {k: tensors[k].contiguous() for k in names if weight_map[k] == file},
            str(folder / file),
            metadata,
        )
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
        "weight_map": weight_map,
    }
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    config = {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "text_config": text_config,
        "transformers_version": text_config.get("transformers_version"),
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "model.safetensors").unlink()
    return index
