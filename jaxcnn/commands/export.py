"""Export a trained run's model for serving: ONNX (for ONNX Runtime, TensorRT; needs
`pip install 'jaxcnn[export]'`) and StableHLO (jax.export's serialized form), both taking a
batch of any size, with a sidecar JSON saying how to turn raw images into the model's input.
Each artefact is run back (ONNX Runtime; jax.export.deserialize) on the run's test set and
must give the run's own logits (rtol 1e-4) before anything is written.

jaxcnn export --run runs/NAME                                 # both formats, to runs/NAME/export/
jaxcnn export --run runs/NAME --format onnx --out served/ --check-examples 2000
"""

from __future__ import annotations

from pathlib import Path

from jaxcnn.commands import cli
from jaxcnn.commands.predict import class_names, fresh_output

PROG = "jaxcnn export"
FORMATS = ("onnx", "stablehlo")  # jaxcnn.export.FORMATS, named here to answer before JAX loads
DEFAULT_EXAMPLES = 512


def parse_flags(argv=None):
    parser = cli.FlagParser(prog=PROG, description=__doc__)
    parser.add_argument("--run", required=True, metavar="DIR", help="a run directory `jaxcnn train` wrote")
    parser.add_argument("--format", default=",".join(FORMATS), help=f"some of {', '.join(FORMATS)}")
    parser.add_argument("--out", metavar="DIR", help="where the files go (default: <run>/export)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing export")
    parser.add_argument(
        "--check-examples", type=int, default=DEFAULT_EXAMPLES, metavar="N",
        help="check each artefact on this many of the run's test examples (the first ones)",
    )  # fmt: skip
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_flags(argv)
    from jaxcnn import runs
    from jaxcnn.errors import UserError
    from jaxcnn.export import FILES, SIDECAR, export_run

    formats = tuple(cli.some_of(args.format, FORMATS, "--format"))
    if args.check_examples < 1:
        raise UserError(f"--check-examples must be a positive integer, got {args.check_examples}")
    fresh_output(Path(args.out) if args.out else None, args.overwrite, "directory")  # before anything slow
    run = runs.open_run(args.run)
    out = Path(args.out) if args.out else run.directory / "export"
    fresh_output(out, args.overwrite, "directory")
    info = export_run(run, formats, out, args.check_examples, class_names(run))
    shape = "x".join(str(d) for d in info["input"]["shape"][1:])
    print(
        f"{run.name}'s model ({info['model']}) as {', '.join(formats)}: input {info['input']['name']} "
        f"[batch, {shape}] {info['input']['dtype']} NHWC, output logits [batch, {len(info['classes'])}]"
    )
    print(f"checked against the run's own logits on {info['check']['data']}, batches of "
          f"{info['check']['results'][0]['batch_sizes'][0]} and 1:")  # fmt: skip
    for check in info["check"]["results"]:
        print(
            f"  {check['format']:<10} max |diff| {check['max_abs_diff']:.2e} ({check['max_rel_diff']:.2e} of the "
            f"largest logit, {check['largest_logit']:.3g}); same predictions {100 * check['same_predictions']:.2f}%"
        )
    print(f"wrote {out} ({', '.join([*(FILES[f] for f in formats), SIDECAR])})")
    return info
