"""Train a CNN under a layout and mesh. Everything the run leaves goes to its run directory,
runs/<name>/ (--results-dir, --run-name): config.json, the result JSON and CSV, the model,
curves.png and TensorBoard logs. An existing run directory is never overwritten.

jaxcnn train                                      # dp over all devices
jaxcnn train --layout single                      # the one-device baseline
jaxcnn train --mesh data=4 --host-devices 4       # 4 simulated CPU devices
jaxcnn train --layout hybrid --mesh data=4,model=2 --print-shardings
jaxcnn train --grad-accum 4 --remat full --dtype bfloat16
jaxcnn train --sync local-sgd --sync-every 8 --optimizer sgd --lr 0.05
jaxcnn train --batch-schedule 0:32,10:64,20:128 --lr-scaling linear --base-batch 32
jaxcnn train --resume --run-name NAME             # continue a run stopped by Ctrl-C or SIGTERM, with its config
jaxcnn train --resume auto --run-name NAME        # continue it if it saved a state, else start it (requeued jobs)

(`python experiments/train.py` is the same command.)
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from jaxcnn import stopping
from jaxcnn.commands import cli, run_flags
from jaxcnn.run_config import ClusterConfig, RunConfig

PROG = "jaxcnn train"
DEFAULT_RESULTS_DIR = "runs"


def parser() -> cli.FlagParser:
    parser = cli.FlagParser(prog=PROG, description=__doc__)
    run_flags.add_model_flags(parser)
    run_flags.add_data_flags(parser)
    run_flags.add_mesh_flags(parser)
    run_flags.add_train_flags(parser)
    run_flags.add_run_flags(parser)
    g = parser.add_argument_group("output")
    g.add_argument("--results-dir", default=DEFAULT_RESULTS_DIR, help="where run directories go")
    g.add_argument("--run-name", help="the run directory's name (default: <model>-<layout>-<mesh>)")
    g.add_argument("--overwrite", action="store_true", help="replace an existing run directory of the same name")
    g.add_argument(
        "--submission", help="where predictions for a label-free test file go (default: <run dir>/submission.csv)"
    )
    g.add_argument("--quiet", action="store_true", help="no progress bar or epoch lines")
    return parser


def parse_flags(argv=None) -> RunConfig:
    """The run's config from its flags; with --resume --run-name NAME, the run's own config
    (its config.json) gives the defaults, so only what changes needs saying."""
    flags = parser()
    args = flags.parse_args(argv)
    run_dir = Path(args.results_dir) / (args.run_name or "")
    if args.resume and args.run_name and run_dir.is_dir():
        from jaxcnn import runs

        saved = runs.read_config(run_dir).to_flags()
        known = {action.dest for action in flags._actions}
        # how this launch runs -- its processes, their devices, CPU devices simulated -- is its own, not the run's
        launch = {*(f.name for f in dataclasses.fields(ClusterConfig)), "host_devices"}
        not_restored = {"resume", "overwrite", *launch}
        flags.set_defaults(**{k: v for k, v in saved.items() if k in known and k not in not_restored})
        args = flags.parse_args(argv)
    return RunConfig.from_flags(args)


def main(argv=None) -> dict:
    stopping.keep_early_stops(sys.argv[1:] if argv is None else argv)  # before anything slow
    config = parse_flags(argv)
    from jaxcnn.run import train  # JAX starts here, after the flags

    return train(config)
