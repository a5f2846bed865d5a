"""`jaxcnn <command>`: the console script (pyproject's [project.scripts]).

    jaxcnn train --layout fsdp --epochs 5
    jaxcnn predict --run runs/<name> --data images/
    jaxcnn evaluate --run runs/<name>
    jaxcnn export --run runs/<name> --format onnx

Each command's module parses its flags before it imports JAX (`main` imports the work
after `parse_flags`), so `--help` and bad flags answer at once. The scripts in
`experiments/` are the same commands under their old names.
"""

from __future__ import annotations

import importlib
import sys

from jaxcnn.commands import cli

COMMANDS = {
    "train": "train a CNN under a layout and mesh; keep the model and the run's logs in runs/<name>/",
    "predict": "predictions of a trained run's model for a CSV or a folder of images",
    "evaluate": "accuracy, loss, per-class accuracy and the confusion matrix of a run's model on labelled data",
    "export": "a run's model as ONNX and StableHLO (any batch), checked against its own logits, with a sidecar JSON",
    "compare": "compare layouts from the compiled program: memory, FLOPs, collective bytes, speed-up",
    "scale": "scaling report: a layout on 1, 2, 4, ... devices, and whether scaling out pays",
    "plan": "rank every layout x mesh for N devices on a hardware profile, within a memory budget",
    "bench": "benchmark one train step: median time, images/s, compile time, MFU",
    "prepare": "store a folder or dataset once as pre-resized shards (raw uint8 or small JPEG) that --data reads",
    "bench-input": "the input pipeline alone: images/s per core for each source and worker count; cores for a rate",
    "bench-loop": "the training loop's cost beyond the compiled step: fit against a bare loop, per way of feeding it",
}


def module_name(command: str) -> str:
    """The module under jaxcnn.commands that runs `command` (bench-input -> bench_input)."""
    return command.replace("-", "_")


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {text}" for name, text in COMMANDS.items()]
    return "usage: jaxcnn COMMAND [flags]   (jaxcnn COMMAND --help for its flags)\n\ncommands:\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        sys.exit(0 if argv else 2)
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(
            f"jaxcnn: error: unknown command {name!r}; use one of {', '.join(COMMANDS)} (see --help)", file=sys.stderr
        )
        sys.exit(2)
    command = importlib.import_module(f"jaxcnn.commands.{module_name(name)}")
    cli.run_main(command.PROG, lambda: command.main(rest))
