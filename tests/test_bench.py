"""experiments/bench.py and the torch twin of compare_backends.py: figures from real compiled steps."""

import math

import numpy as np
import pandas as pd
import pytest
from conftest import load_script


@pytest.fixture(scope="module")
def first_bench(tmp_path_factory):
    """bench's every variant, compiled into an empty cache of its own (the output directory)."""
    from jaxcnn import compile_cache

    out = tmp_path_factory.mktemp("bench")
    try:
        load_script("bench").main(["--configs", "default", "--steps", "2", "--rounds", "2", "--out",
                                   str(out / "bench.csv"), "--compile-cache", str(out / "cache")])  # fmt: skip
    finally:
        compile_cache.enable(None)
    return out


def test_bench_reports_flops_and_an_mfu_below_the_measured_peak(first_bench):
    from jaxcnn.config import DEFAULT_MODEL

    frame = pd.read_csv(first_bench / "bench.csv")
    assert set(frame["variant"]) == {"jaxcnn-single", "jaxcnn-dp1", "plain-jit", "plain-jit-cpu-options"}
    assert (frame["model"] == DEFAULT_MODEL).all() and (frame["config"] == "default").all()
    assert (frame["steps"] == 2).all()
    assert (frame["flops_per_step"] > 0).all() and (frame["images_per_second"] > 0).all()
    assert ((frame["mfu"] > 0) & (frame["mfu"] <= 1)).all()
    # the variants compile the same computation: the same FLOPs within 2%
    assert frame["flops_per_step"].max() <= 1.02 * frame["flops_per_step"].min()
    # each variant's time to its first step holds its tracing, compile and first step
    startup = frame["lower_seconds"] + frame["compile_seconds"] + frame["first_step_seconds"]
    assert (frame["time_to_first_step_seconds"] >= startup).all() and (frame["compile_seconds"] > 0).all()


def test_bench_variants_and_a_second_run_reads_its_programs_from_the_cache(first_bench, tmp_path):
    """The first run: every variant's, above; the second, two of them, reads the same cache."""
    from jaxcnn import compile_cache

    flags = ["--configs", "default", "--steps", "1", "--rounds", "1", "--variants", "jaxcnn-dp1,plain-jit",
             "--compile-cache", str(first_bench / "cache"), "--out", str(tmp_path / "second.csv")]  # fmt: skip
    try:
        second = load_script("bench").main(flags)
    finally:
        compile_cache.enable(None)
    first = pd.read_csv(first_bench / "bench.csv").set_index("variant")["cached"]
    assert [r["variant"] for r in second] == ["jaxcnn-dp1", "plain-jit"]
    assert list(first[["jaxcnn-dp1", "plain-jit"]]) == [False, False] and [r["cached"] for r in second] == [True, True]


def _default_cnn_params(side: int, channels: int) -> int:
    """The default CNN by hand: 3x3 convs of 32, 64, 128 (no bias: batch norm's scale and
    bias instead), three SAME 2x2 pools (side -> ceil(side / 8)), dense 256, 128, 10."""
    convs = 9 * (channels * 32 + 32 * 64 + 64 * 128) + 2 * (32 + 64 + 128)
    flat = math.ceil(side / 8) ** 2 * 128
    return convs + flat * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10


# torchvision's counts (resnet18 11,689,512, resnet50 25,557,032) with 10 classes, not 1,000;
# resnet18 at 32x32 on the 3x3 stem instead of the 7x7: 9 x 3 x 64 weights, not 49 x 3 x 64
BENCH_PARAMS = {
    "default": _default_cnn_params(8, 1),
    "28": _default_cnn_params(28, 1),
    "224": _default_cnn_params(224, 3),
    "resnet18-32": 11_689_512 - 990 * (512 + 1) - 40 * 3 * 64,
    "resnet50-224": 25_557_032 - 990 * (2048 + 1),
}


@pytest.mark.parametrize("name", list(BENCH_PARAMS))
def test_every_bench_config_builds_its_model(name):
    """The model bench builds for each config (shapes only, no initialisation): its
    parameters counted by hand, and logits for the config's batch."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxcnn.commands import bench
    from jaxcnn.config import ModelConfig
    from jaxcnn.models import build_model, count_params

    assert set(bench.CONFIGS) == set(BENCH_PARAMS) and set(bench.DEFAULT_CONFIGS.split(",")) <= set(bench.CONFIGS)
    config = bench.CONFIGS[name]
    assert config.batch >= 1 and config.steps >= config.rounds >= 1
    model_config = ModelConfig(name=config.model)  # as bench.main builds it
    model = nnx.eval_shape(lambda: build_model(model_config, config.image_shape, seed=0))
    params = count_params(model)
    assert params == BENCH_PARAMS[name], f"{name}: {params:,} parameters, by hand {BENCH_PARAMS[name]:,}"
    graphdef, state = nnx.split(model)
    images = jax.ShapeDtypeStruct((config.batch, *config.image_shape), jnp.float32)
    logits = jax.eval_shape(lambda s, x: nnx.merge(graphdef, s)(x, train=False), state, images)
    assert logits.shape == (config.batch, model_config.num_classes)


def test_bench_fill_finds_the_largest_batch_within_the_budget():
    import jax
    from conftest import TINY_PLAIN

    from jaxcnn.analysis.baselines import fill_batch

    device = jax.devices()[0]
    roomy = fill_batch(TINY_PLAIN, (8, 8, 1), device, 1e12, multiple=32, limit=64)
    assert roomy.batch_size == 64  # everything fits: the cap
    peaks = dict(roomy.probes)
    assert peaks[32] < peaks[64]  # memory grows with the batch
    tight = fill_batch(TINY_PLAIN, (8, 8, 1), device, (peaks[32] + peaks[64]) / 2, multiple=32, limit=64)
    assert tight.batch_size == 32 and tight.peak_bytes <= tight.budget_bytes < dict(tight.probes)[64]


def test_bench_fill_on_a_device_without_memory_figures_asks_for_a_budget(tmp_path, monkeypatch):
    from jaxcnn.analysis import baselines
    from jaxcnn.commands import bench
    from jaxcnn.errors import UserError

    out = str(tmp_path / "bench.csv")
    monkeypatch.setattr(baselines, "device_memory_bytes", lambda device: None)  # as a CPU reports
    with pytest.raises(UserError, match="--fill-memory"):
        bench.main(["--configs", "default", "--batch", "fill", "--out", out])
    with pytest.raises(UserError, match="--batch fill"):
        bench.main(["--configs", "default", "--fill-memory", "1GiB", "--out", out])
    with pytest.raises(SystemExit):
        bench.parse_flags(["--batch", "0"])


# (model, stem, input shape, tolerance): the CNN, and ResNet-18 with each stem (deeper: looser)
TWINS = [("cnn2d_3layer_fullconnected_3layer", "auto", (28, 28, 1), 1e-5),
         ("resnet18", "small", (16, 16, 3), 1e-4), ("resnet18", "imagenet", (64, 64, 3), 1e-4)]  # fmt: skip


@pytest.mark.parametrize("name, stem, shape, tolerance", TWINS)
def test_torch_twin_computes_what_jaxcnn_computes(name, stem, shape, tolerance):
    torch = pytest.importorskip("torch")
    if name.startswith("resnet"):
        pytest.importorskip("torchvision")
    import jax.numpy as jnp

    from jaxcnn.benchmarks import torch_twin
    from jaxcnn.config import ModelConfig
    from jaxcnn.models import build_model

    config = ModelConfig(name=name, stem=stem)
    jax_model = build_model(config, shape, 0)
    twin = torch_twin.torch_model(jax_model, config).train()
    images = np.random.default_rng(0).random((4, *shape), dtype=np.float32)
    with torch.no_grad():
        theirs = twin(torch.from_numpy(images)).numpy()
    ours = np.asarray(jax_model(jnp.asarray(images), train=True))
    np.testing.assert_allclose(theirs, ours, atol=tolerance)
    agreement = torch_twin.check_agreement(jax_model, twin, images, np.arange(4, dtype=np.int32))
    assert agreement["jaxcnn"] < tolerance and agreement["torch"] < tolerance  # both near the float64 answer
    assert agreement["loss_diff"] < 1e-5


def test_backend_comparison_refuses_models_that_disagree():
    torch = pytest.importorskip("torch")

    from jaxcnn.benchmarks import torch_twin
    from jaxcnn.config import ModelConfig
    from jaxcnn.errors import UserError
    from jaxcnn.models import build_model

    jax_model = build_model(ModelConfig(), (28, 28, 1), 0)
    twin = torch_twin.torch_model(jax_model, ModelConfig())
    with torch.no_grad():
        twin.dense[-1].bias[0] += 1.0  # one class favoured (a uniform shift would leave the loss alone)
    images = np.random.default_rng(0).random((4, 28, 28, 1), dtype=np.float32)
    with pytest.raises(UserError, match="disagree on the loss"):
        torch_twin.check_agreement(jax_model, twin, images, np.arange(4, dtype=np.int32))


def _resnet18(stem: str, side: int):
    from jaxcnn.config import ModelConfig
    from jaxcnn.models import build_model

    config = ModelConfig(name="resnet18", stem=stem)
    return config, build_model(config, (side, side, 3), 0)


def test_resnet_twin_holds_every_jax_weight_and_statistic():
    torch = pytest.importorskip("torch")
    torchvision = pytest.importorskip("torchvision")
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxcnn.benchmarks import torch_twin

    config, jax_model = _resnet18("small", 16)
    # fresh norms are 1s and 0s in both libraries: move every jax value, so a tensor left
    # unwritten still equals torchvision's initial one
    rng = np.random.default_rng(1)
    for path, variable in nnx.iter_graph(jax_model):
        if isinstance(variable, (nnx.Param, nnx.BatchStat)):
            value = np.asarray(variable.get_value())
            factor = rng.uniform(0.5, 1.5, value.shape).astype(value.dtype)
            scaled = path[-1] in ("kernel", "scale", "var")  # a variance stays positive
            variable.set_value(jnp.asarray(value * factor if scaled else value + factor - 1))
    torch.manual_seed(0)
    twin = torch_twin.torch_model(jax_model, config)
    torch.manual_seed(0)  # the same initial values as the twin started from
    fresh = torchvision.models.resnet18(num_classes=config.num_classes).state_dict()
    written = {k: v for k, v in twin.net.state_dict().items() if not k.endswith("num_batches_tracked")}
    assert len(written) == len(jax.tree.leaves(nnx.state(jax_model, nnx.Param, nnx.BatchStat))) == 102
    assert set(written) <= set(fresh)
    assert not [k for k, v in written.items() if v.shape == fresh[k].shape and torch.equal(v, fresh[k])]
    # the running statistics are what an eval-mode forward uses (conv1, the small stem's, too)
    images = np.random.default_rng(0).random((4, 16, 16, 3), dtype=np.float32)
    with torch.no_grad():
        theirs = twin.eval()(torch.from_numpy(images)).numpy()
    np.testing.assert_allclose(theirs, np.asarray(jax_model(jnp.asarray(images), train=False)), atol=1e-4)


def test_torch_runs_on_the_kind_of_device_jax_runs_on():
    from jaxcnn.benchmarks.torch_twin import torch_setup
    from jaxcnn.errors import UserError

    cpu = torch_setup("cpu", "float32", cuda_available=True)  # a CUDA torch still compares on the CPU
    assert (cpu.device, cpu.channels_last, cpu.cudnn_benchmark, cpu.dtype) == ("cpu", False, False, "float32")
    assert torch_setup("cpu", "bfloat16", cuda_available=False).dtype == "bfloat16"
    gpu = torch_setup("gpu", "bfloat16", cuda_available=True)
    assert (gpu.device, gpu.channels_last, gpu.cudnn_benchmark, gpu.dtype) == ("cuda", True, True, "bfloat16")
    with pytest.raises(UserError, match=r"torch.cuda.is_available\(\) is false.*JAX_PLATFORMS=cpu"):
        torch_setup("gpu", "float32", cuda_available=False)
    with pytest.raises(UserError, match="not tpu"):
        torch_setup("tpu", "float32", cuda_available=False)
    with pytest.raises(UserError, match="float16"):
        torch_setup("cpu", "float16", cuda_available=False)


def test_torch_twin_steps_channels_last_under_bfloat16_autocast():
    torch = pytest.importorskip("torch")

    from jaxcnn.benchmarks import torch_twin
    from jaxcnn.config import ModelConfig
    from jaxcnn.models import build_model

    config, shape = ModelConfig(), (12, 12, 1)
    images = np.random.default_rng(0).random((4, *shape), dtype=np.float32)
    nchw = torch_twin.place(torch_twin.torch_model(build_model(config, shape, 0), config), torch_twin.CPU_FLOAT32)
    setup = torch_twin.CPU_FLOAT32._replace(channels_last=True, dtype="bfloat16")  # the GPU's layout, on the CPU
    twin = torch_twin.place(torch_twin.torch_model(build_model(config, shape, 0), config), setup)
    assert twin.blocks[0].weight.is_contiguous(memory_format=torch.channels_last)
    with torch.no_grad():  # the memory format changes no value
        np.testing.assert_allclose(twin(torch.from_numpy(images)), nchw(torch.from_numpy(images)), atol=1e-6)
    seconds = torch_twin.torch_step_seconds(twin, images, np.arange(4, dtype=np.int32), 2, setup=setup, warmup=0)
    assert len(seconds) == 2 and min(seconds) > 0
    assert twin.blocks[0].weight.dtype == torch.float32  # autocast computes in bfloat16, parameters stay fp32


def test_torch_workers_report_first_steps_and_fail_on_one_line():
    pytest.importorskip("torch")

    from jaxcnn.benchmarks.torch_twin import FIRST_STEPS, TorchWorkerError, TorchWorkers
    from jaxcnn.config import ModelConfig

    images = np.random.default_rng(0).random((4, 8, 8, 1), dtype=np.float32)
    labels = np.arange(4, dtype=np.int32)
    workers = TorchWorkers(ModelConfig(), (8, 8, 1), images, labels)
    try:
        assert workers.first_steps_seconds > 0  # FIRST_STEPS steps of a fresh model
        assert len(workers(2)) == 2 and workers.peak_memory_bytes is None  # the CPU reports no peak
    finally:
        workers.close()
    assert FIRST_STEPS == 5
    # a twin the worker cannot build: its error comes back on one line, not as a wait for a reply
    with pytest.raises(TorchWorkerError, match="torch worker: UserError: the torch twin is written for batch norm"):
        TorchWorkers(ModelConfig(norm="none"), (8, 8, 1), images, labels)


@pytest.mark.slow
def test_compare_backends_rows_carry_dtype_first_steps_and_memory(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # main sets it: restored after the test
    out = tmp_path / "compare.csv"
    flags = ["--configs", "cnn-28", "--batch", "8", "--steps", "2", "--rounds", "1", "--no-ddp", "--out", str(out)]
    load_script("compare_backends").main(flags)
    frame = pd.read_csv(out)
    assert list(zip(frame["backend"], frame["variant"], frame["host_malloc"], strict=True)) == [
        ("jaxcnn", "single", "keep-freed"), ("torch", "single", "glibc-default"), ("torch", "single", "keep-freed")
    ]  # fmt: skip
    assert (frame["global_batch_size"] == 8).all() and (frame["dtype"] == "float32").all()
    assert (frame["first_steps_seconds"] > 0).all() and frame["peak_memory_bytes"].isna().all()
    jaxcnn = frame[frame["backend"] == "jaxcnn"].iloc[0]
    assert jaxcnn["compile_seconds"] > 0 and jaxcnn["compile_cached"] in (True, False)
    assert frame[frame["backend"] == "torch"]["compile_seconds"].isna().all()  # eager compiles nothing
