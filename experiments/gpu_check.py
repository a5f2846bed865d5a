"""One prepared check for a lent GPU (one H200): time to the first step, cold and from the
compile cache, images/s against PyTorch, and the platform choices, within one time budget.

python experiments/gpu_check.py                        # on the GPU machine, from the repo root
python experiments/gpu_check.py --budget 200           # a second call: the steps not done yet
python experiments/gpu_check.py --smoke                # here: every step, tiny, on the CPU
python experiments/gpu_check.py fetch-wheels           # here, with network: what the GPU image lacks -> .whl/
                                                       # (and Fashion-MNIST's files, from this machine's)

The GPU machine has no network; its python3 holds jax 0.11.2 with the CUDA 13 plugin, flax,
optax, orbax, torch 2.11 and torchvision 0.26 but not grain, array-record, portpicker or
tensorboardX: `fetch-wheels` downloads those here into .whl/ (git-ignored), to be carried
along (device tool: carry [".whl"]); this script installs them with pip --target into
/tmp/gpu_check_site and runs every step with that and the checkout on PYTHONPATH.

Steps, in order of importance, each a process under its own timeout (the smaller of its cap
and the budget left; one that fails or times out is logged and the next runs; a step whose
result file exists is skipped, so a second call goes on where the first stopped):

  env               nvidia-smi, versions, devices, whether jaxcnn keeps host malloc settings
  loop_overhead     jaxcnn bench-loop, the tiny CNN on the digits: fit against a bare loop over the
                    same compiled call, per way of feeding the step (how much the loop leaves idle)
  loop_fashion      loop_fashion.py: Fashion-MNIST, the default CNN, 2 epochs: images/s of the host
                    loader, data on the device, that with 64 steps a call, and PyTorch eager on the
                    GPU (the IDX files carried in .whl/fashion-mnist by fetch-wheels)
  torch_bf16        compare_backends.py cnn-224,resnet50-224 batch 256 bf16: PyTorch eager as GPU
                    users run it (channels_last, bf16 autocast, cudnn.benchmark) against jaxcnn,
                    same weights, alternating; jaxcnn's compiles here are the cold ones
  bench_rn50_bf16   jaxcnn bench resnet50-224 batch 256 bf16 in a new process: the warm compile
                    (the cache), images/s, MFU against a matmul peak measured in the run
  train_cnn_cold    jaxcnn train --synthetic 224x224x3 batch 256, an empty compile cache: the
  train_cnn_warm    run record's per-program compile seconds; then the same run again (warm)
  choices_rn50      platform_choices.py conv1x1,autotune on resnet50 224 bf16 batch 256 (dot,
                    conv; levels 4 and 0): each program compiled cold in its own process, read
                    back from the cache, then timed alternating
  bench_rn50_fp32   resnet50 fp32 batch 256: the cold compile
  torch_fp32        compare_backends.py in fp32 (resnet50's compile read from the cache: warm)
  choices_cnn       platform_choices.py max_pool on the default CNN 224 fp32 batch 256
  torch_compile     compare_backends.py with --torch-compile, bf16

Results go to runs/gpu_check/ (--results; git-ignored, so a second call on the same machine
finds them), one CSV or JSON per step plus its log; with $OUT set, a tarball of them and
the summary are copied there after every step. The last thing printed is one table:
gpu_check_summary.csv.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[1]
WHEELS = (
    "grain==0.2.18",
    "array-record==0.8.6",
    "portpicker==1.6.0",
    "tensorboardx==2.6.4",
    "importlib-resources==6.5.2",
)
SITE = "/tmp/gpu_check_site"
RN50 = ["--model", "resnet50", "--image", "224x224x3", "--batch", "256"]
CNN = ["--model", "cnn2d_3layer_fullconnected_3layer", "--image", "224x224x3", "--batch", "256"]

ENV_SCRIPT = """
import importlib.metadata, sys
import flax, jax, jaxlib
from jaxcnn import host_memory
print("python", sys.version.split()[0], "jax", jax.__version__, "jaxlib", jaxlib.__version__, "flax", flax.__version__)
print("jax plugins", [e.name for e in importlib.metadata.entry_points(group="jax_plugins")])
print("jaxcnn keeps host malloc settings here:", host_memory.computes_on_cpu())
print("devices", jax.devices())
print("memory", jax.devices()[0].memory_stats())
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.cuda.is_available())
except ImportError:
    print("no torch")
if jax.devices()[0].platform != "gpu" and sys.argv[-1] != "smoke":
    sys.exit("no GPU: JAX runs on " + jax.devices()[0].platform)
"""


def steps(smoke: bool, results: Path, python: str, wheels: str) -> list[tuple[str, int, str, list[str]]]:
    """(name, cap in seconds, its result file, command) of every step, in order."""
    py = [python]
    exp = REPO / "experiments"
    rn50, cnn = RN50, CNN
    choices_rn50 = ["--choices", "conv1x1,autotune", "--variants", "dot,conv,4,0", "--dtype", "bfloat16"]
    timing = ["--steps", "30", "--rounds", "3"]
    torch_timing = ["--steps", "20", "--rounds", "2", "--batch", "256"]
    if smoke:
        rn50 = ["--model", "resnet_tiny_bottleneck", "--image", "64x64x3", "--batch", "8"]
        cnn = ["--model", "cnn2d_3layer_fullconnected_3layer", "--image", "32x32x3", "--batch", "8"]
        choices_rn50 = ["--choices", "conv1x1", "--dtype", "bfloat16"]
        timing = ["--steps", "2", "--rounds", "1"]
        torch_timing = ["--steps", "2", "--rounds", "1", "--batch", "8"]

    def bench(dtype: str, out: str) -> list[str]:
        config = "28" if smoke else "resnet50-224"
        batch = "8" if smoke else "256"
        return [*py, str(exp / "bench.py"), "--configs", config, "--batch", batch, "--dtype", dtype,
                "--variants", "jaxcnn-single", *timing, "--out", str(results / out)]  # fmt: skip

    def train(name: str) -> list[str]:
        shape = "32x32x3" if smoke else "224x224x3"
        batch = "8" if smoke else "256"
        return [*py, str(exp / "train.py"), "--synthetic", shape, "--synthetic-size", str(10 * int(batch)),
                "--batch-size", batch, "--epochs", "1", "--results-dir", str(results / "runs"), "--run-name", name,
                "--quiet", "--compile-cache", str(results / "train_cache")]  # fmt: skip

    def torch(dtype: str, out: str, *extra: str) -> list[str]:
        configs = "cnn-28" if smoke else "cnn-224,resnet50-224"  # the smaller first: JAX keeps one peak per process
        return [*py, str(exp / "compare_backends.py"), "--configs", configs, "--dtype", dtype, "--no-ddp",
                *torch_timing, *extra, "--out", str(results / out)]  # fmt: skip

    choices = [*py, str(exp / "platform_choices.py"), "--timeout", "30" if smoke else "300", *timing]
    loop = ["--steps", "3000", "--rounds", "3"]
    fashion = ["--epochs", "2", "--steps-per-call", "64", "--data-dir", str(Path(wheels) / "fashion-mnist")]
    if smoke:
        loop = ["--steps", "40", "--rounds", "1", "--steps-per-call", "4"]
        fashion = ["--epochs", "1", "--train-size", "512", "--steps-per-call", "2"]
        if importlib.util.find_spec("torch") is None:  # the test extra has no torch; the GPU machine has
            fashion += ["--variants", "jaxcnn-host,jaxcnn-device,jaxcnn-device-K"]
    return [
        ("env", 90, "env.log", [*py, "-c", ENV_SCRIPT, "smoke" if smoke else "gpu"]),
        ("loop_overhead", 180, "loop_overhead.csv", [*py, "-m", "jaxcnn", "bench-loop", "--cases", "tiny", "--data",
         "digits", *loop, "--out", str(results / "loop_overhead.csv")]),
        ("loop_fashion", 300, "loop_fashion.csv", [*py, str(exp / "loop_fashion.py"), *fashion,
         "--out", str(results / "loop_fashion.csv")]),
        ("torch_bf16", 420, "torch_bf16.csv", torch("bfloat16", "torch_bf16.csv")),
        ("bench_rn50_bf16", 120, "bench_rn50_bf16.csv", bench("bfloat16", "bench_rn50_bf16.csv")),
        ("train_cnn_cold", 150, "runs/cnn_cold/cnn_cold.json", train("cnn_cold")),
        ("train_cnn_warm", 90, "runs/cnn_warm/cnn_warm.json", train("cnn_warm")),
        ("choices_rn50", 600, "choices_rn50.csv",
         [*choices, *rn50, *choices_rn50, "--out", str(results / "choices_rn50.csv")]),
        ("bench_rn50_fp32", 360, "bench_rn50_fp32.csv", bench("float32", "bench_rn50_fp32.csv")),
        ("torch_fp32", 240, "torch_fp32.csv", torch("float32", "torch_fp32.csv")),
        ("choices_cnn", 300, "choices_cnn.csv",
         [*choices, *cnn, "--choices", "max_pool", "--out", str(results / "choices_cnn.csv")]),
        ("torch_compile", 300, "torch_compile.csv", torch("bfloat16", "torch_compile.csv", "--torch-compile")),
    ]  # fmt: skip


def parse_flags(argv=None):
    parser = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("action", nargs="?", default="run", choices=("run", "fetch-wheels"))
    parser.add_argument("--budget", type=float, default=540, help="seconds for every step together")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, the same steps")
    parser.add_argument("--results", help="default: runs/gpu_check (smoke: /tmp/gpu_check_smoke)")
    parser.add_argument("--only", help="comma-separated step names (default: every step not done yet)")
    parser.add_argument("--wheels", default=str(REPO / ".whl"))
    parser.add_argument("--python", default=sys.executable)
    return parser.parse_args(argv)


def fetch_wheels(directory: str, python: str) -> None:
    platforms = [f"--platform=manylinux_{n}_x86_64" for n in ("2_28", "2_27", "2_24", "2_17")]
    subprocess.run(
        [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
         "--implementation", "cp", *platforms, "--platform=manylinux2014_x86_64", "--platform=any", "-d", directory,
         *WHEELS],
        check=True,
    )  # fmt: skip
    # Fashion-MNIST's IDX files for loop_fashion (the GPU machine has no network): about 30 MB
    from jaxcnn.data.datasets import locate

    target = Path(directory) / "fashion-mnist"
    target.mkdir(parents=True, exist_ok=True)
    for path in locate("fashion-mnist", None, False).values():
        shutil.copy(path, target / path.name)


def install_wheels(directory: str, python: str) -> dict:
    """The wheels into SITE (pip --target, as the device README says: no venv); the environment
    every step runs in."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    wheels = sorted(Path(directory).glob("*.whl"))
    if wheels:
        subprocess.run(
            [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
             "--upgrade", "--target", SITE, *map(str, wheels)],
            check=True,
        )  # fmt: skip
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [SITE, str(REPO), os.environ.get("PYTHONPATH")]))
    else:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return env


def main(argv=None) -> int:
    args = parse_flags(argv)
    if args.action == "fetch-wheels":
        fetch_wheels(args.wheels, args.python)
        return 0
    results = Path(args.results or ("/tmp/gpu_check_smoke" if args.smoke else REPO / "runs" / "gpu_check"))
    results.mkdir(parents=True, exist_ok=True)
    env = install_wheels(args.wheels, args.python)
    env["JAXCNN_CACHE"] = str(results / "cache")  # every step shares one compile cache
    if args.smoke:
        env["JAX_PLATFORMS"] = "cpu"
    only = set(args.only.split(",")) if args.only else None
    log = results / "steps.csv"
    started = time.monotonic()
    for name, cap, result, command in steps(args.smoke, results, args.python, args.wheels):
        if (only and name not in only) or (not only and (results / result).exists() and name != "env"):
            continue
        left = args.budget - (time.monotonic() - started)
        limit = min(cap, left)
        if limit < 30:
            print(f"=== {name}: skipped, {left:.0f} s of the budget left", flush=True)
            _log(log, name, "skipped", 0.0, limit)
            continue
        print(f"=== {name} (timeout {limit:.0f} s): {' '.join(command[:6])} ...", flush=True)
        began = time.monotonic()
        status = _run(command, env, results / f"{name}.log", limit)
        print(f"=== {name}: {status}, {time.monotonic() - began:.0f} s", flush=True)
        _log(log, name, status, time.monotonic() - began, limit)
        _package(results)
    table = summary(results)
    print(table.to_string(index=False) if len(table) else "no figures")
    _package(results)
    return 0


def _run(command: list[str], env: dict, log: Path, limit: float) -> str:
    """Run one step, its output to the terminal and its log, killed (with its children) at the
    limit; its status."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                            start_new_session=True)  # fmt: skip

    def copy():
        with open(log, "wb") as out:
            for line in proc.stdout:
                sys.stdout.write(line.decode(errors="replace"))
                sys.stdout.flush()
                out.write(line)

    reader = threading.Thread(target=copy, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        reader.join(5)
        return f"timed out after {limit:.0f} s"
    reader.join(5)
    return "ok" if code == 0 else f"failed (exit {code})"


def _log(path: Path, name: str, status: str, seconds: float, limit: float) -> None:
    row = pd.DataFrame([{"step": name, "status": status, "seconds": round(seconds, 1), "timeout": round(limit)}])
    row.to_csv(path, mode="a", header=not path.exists(), index=False)


def _package(results: Path) -> None:
    """Everything so far as one tarball in $OUT (the device tool brings back 8 files)."""
    out = os.environ.get("OUT")
    if not out:
        return
    with tarfile.open(Path(out) / "gpu_check.tar.gz", "w:gz") as tar:
        for path in sorted(results.rglob("*")):
            relative = path.relative_to(results)
            if path.is_file() and relative.parts[0] not in ("cache", "train_cache") and "model" not in relative.parts:
                tar.add(path, arcname=str(relative))
    for name in ("steps.csv", "summary.csv"):
        if (results / name).exists():
            shutil.copy(results / name, Path(out) / f"gpu_check_{name}")


def summary(results: Path) -> pd.DataFrame:
    """One row per workload from whatever the steps wrote: jaxcnn and PyTorch images/s (one run,
    alternating), jaxcnn's compile cold (the first process to compile it) and warm (a later
    process reading the cache), peak memory, MFU; then `jaxcnn train`'s time to the first step."""
    frames = {name: pd.read_csv(results / name) for name in CSVS if (results / name).exists()}
    compiles = []  # (config, dtype, compile seconds, read from the cache?) in the order measured
    for name, frame in frames.items():
        if name.startswith("torch"):
            for _, r in frame[frame["backend"] == "jaxcnn"].iterrows():
                compiles.append((r["config"], r["dtype"], r["compile_seconds"], bool(r["compile_cached"])))
        elif name.startswith("bench"):
            for _, r in frame.iterrows():
                config = "resnet50-224" if r["model"] == "resnet50" else f"cnn-{r['config']}"
                compiles.append((config, r["dtype"], r["compile_seconds"], bool(r["cached"])))
    rows = []
    for name in ("torch_bf16.csv", "torch_fp32.csv"):
        frame = frames.get(name)
        for _, jaxcnn in [] if frame is None else frame[frame["backend"] == "jaxcnn"].iterrows():
            config, dtype = jaxcnn["config"], jaxcnn["dtype"]
            mine = frame[(frame["config"] == config) & (frame["backend"] == "torch")]
            eager = mine[mine["variant"] == "single"]
            row = {"workload": f"{config} batch {jaxcnn['global_batch_size']} {dtype}",
                   "jaxcnn_images_per_second": jaxcnn["images_per_second"], "jaxcnn_mfu": jaxcnn["mfu"],
                   "jaxcnn_peak_gib": jaxcnn["peak_memory_bytes"] / 2**30}  # fmt: skip
            for cached, column in ((False, "jaxcnn_compile_cold_seconds"), (True, "jaxcnn_compile_warm_seconds")):
                found = [c[2] for c in compiles if c[:2] == (config, dtype) and c[3] is cached]
                row[column] = found[0] if found else None
            if len(eager):
                e = eager.iloc[0]
                row.update(torch_eager_images_per_second=e["images_per_second"],
                           vs_torch_eager=jaxcnn["images_per_second"] / e["images_per_second"],
                           torch_peak_gib=e["peak_memory_bytes"] / 2**30,
                           torch_first_steps_seconds=e["first_steps_seconds"])  # fmt: skip
            compiled = frames.get("torch_compile.csv")
            if compiled is not None and dtype == "bfloat16":
                c = compiled[(compiled["config"] == config) & (compiled["variant"] == "compiled")]
                if len(c):
                    row.update(torch_compiled_images_per_second=c.iloc[0]["images_per_second"],
                               torch_compile_seconds=c.iloc[0]["compile_seconds"])  # fmt: skip
            rows.append(row)
    if (results / "loop_overhead.csv").exists():
        for _, r in pd.read_csv(results / "loop_overhead.csv").iterrows():
            rows.append({"workload": f"loop: {r['case']} CNN on {r['data']}, {r['mode']} (K={r['steps_per_call']})",
                         "fit_ms_per_step": r["fit_ms_per_step"], "bare_ms_per_step": r["bare_ms_per_step"],
                         "fit_over_bare": r["fit_over_bare"]})  # fmt: skip
    if (results / "loop_fashion.csv").exists():
        fashion = pd.read_csv(results / "loop_fashion.csv")
        for variant, runs in fashion.groupby("variant", sort=False):
            column = "torch_eager_images_per_second" if variant.startswith("torch") else "jaxcnn_images_per_second"
            rows.append({"workload": f"Fashion-MNIST, default CNN, batch 128: {variant}",
                         column: runs["images_per_second"].iloc[1:].median() if len(runs) > 1
                         else runs["images_per_second"].iloc[0]})  # fmt: skip
    for name in ("cnn_cold", "cnn_warm"):
        path = results / "runs" / name / f"{name}.json"
        if path.exists():
            record = json.loads(path.read_text())
            rows.append({"workload": f"jaxcnn train ({name.split('_')[1]}), {record['model']}, "
                         f"{'x'.join(map(str, record['image_shape']))} batch {record['global_batch_size']}",
                         "jaxcnn_images_per_second": record["images_per_second"],
                         "jaxcnn_compile_cold_seconds" if name == "cnn_cold" else "jaxcnn_compile_warm_seconds":
                             record["compile_seconds"],
                         "time_to_first_step_seconds": record["time_to_first_step_seconds"]})  # fmt: skip
    table = pd.DataFrame(rows)
    table.to_csv(results / "summary.csv", index=False)
    return table


CSVS = ("torch_bf16.csv", "bench_rn50_bf16.csv", "bench_rn50_fp32.csv", "torch_fp32.csv")


if __name__ == "__main__":
    sys.exit(main())
