"""``python -m gemma_nb.tiny train [--dims tiny|tp2] [--seed N] [--max-epochs N] [--out DIR]``:
train a checkpoint."""

import argparse
from pathlib import Path

from gemma_nb.tiny import CHECKPOINT_DIRS, DIMS
from gemma_nb.tiny.train import TrainArgs, train


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gemma_nb.tiny", description=__doc__)
    train_cmd = parser.add_subparsers(dest="command", required=True).add_parser(
        "train", help="train the tiny Gemma-4 MoE on the fact corpus and save it"
    )
    train_cmd.add_argument("--seed", type=int, default=0)
    train_cmd.add_argument("--max-epochs", type=int, default=TrainArgs.max_epochs)
    train_cmd.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: bit-reproducible, and no thread oversubscription on a shared box)",
    )
    train_cmd.add_argument(
        "--dims",
        choices=sorted(DIMS),
        default="tiny",
        help="tiny: the bundled checkpoint; tp2: the one whose heads and experts split over TP=2",
    )
    train_cmd.add_argument(
        "--out", type=Path, default=None, help="output folder (default: the bundled one for --dims)"
    )
    args = parser.parse_args(argv)
    out = CHECKPOINT_DIRS[args.dims] if args.out is None else args.out
    summary = train(
        TrainArgs(seed=args.seed, max_epochs=args.max_epochs, threads=args.threads, dims=args.dims),
        out_dir=out,
    )
    print(
        f"saved {out}: recall {summary['final_recall_fp32']:.3f} after {summary['steps_run']} "
        f"steps, {summary['train_seconds']} s"
    )


if __name__ == "__main__":
    main()
