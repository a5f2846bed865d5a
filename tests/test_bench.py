"""experiments/bench.py and the torch twin of compare_backends.py: figures from real compiled steps."""

import numpy as np
import pandas as pd
import pytest
from conftest import load_script


def test_bench_reports_flops_and_an_mfu_below_the_measured_peak(tmp_path):
    out = tmp_path / "bench.csv"
    load_script("bench").main(["--configs", "default", "--steps", "2", "--rounds", "2", "--out", str(out)])
    frame = pd.read_csv(out)
    assert set(frame["variant"]) == {"jaxcnn-single", "jaxcnn-dp1", "plain-jit", "plain-jit-cpu-options"}
    assert (frame["steps"] == 2).all()
    assert (frame["flops_per_step"] > 0).all() and (frame["images_per_second"] > 0).all()
    assert ((frame["mfu"] > 0) & (frame["mfu"] <= 1)).all()
    # the variants compile the same computation: the same FLOPs within 2%
    assert frame["flops_per_step"].max() <= 1.02 * frame["flops_per_step"].min()


def test_torch_twin_computes_what_jaxcnn_computes():
    torch = pytest.importorskip("torch")
    import jax.numpy as jnp

    from jaxcnn.analysis import torch_twin
    from jaxcnn.config import ModelConfig
    from jaxcnn.models import build_model

    config = ModelConfig()
    images = np.random.default_rng(0).random((4, 28, 28, 1), dtype=np.float32)
    jax_model = build_model(config, (28, 28, 1), 0)
    twin = torch_twin.torch_model(jax_model, config).train()
    with torch.no_grad():
        theirs = twin(torch.from_numpy(images)).numpy()
    ours = np.asarray(jax_model(jnp.asarray(images), train=True))
    np.testing.assert_allclose(theirs, ours, atol=1e-5)
    agreement = torch_twin.check_agreement(jax_model, twin, images, np.arange(4, dtype=np.int32))
    assert agreement["jaxcnn"] < 1e-5 and agreement["torch"] < 1e-5  # both near the float64 answer
    assert agreement["loss_diff"] < 1e-5


def test_backend_comparison_refuses_models_that_disagree():
    torch = pytest.importorskip("torch")

    from jaxcnn.analysis import torch_twin
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
