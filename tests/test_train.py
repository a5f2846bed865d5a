"""Training: the loss falls; seeding is deterministic; optimizers and schedules follow their
rules; a diverging run is named. (Layouts against one device: tests/test_equivalence.py.)"""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_PLAIN, train_losses

from jaxcnn.config import OptimConfig, TrainConfig, epoch_steps
from jaxcnn.errors import UserError
from jaxcnn.fit import Resume, diverged_at
from jaxcnn.optim import make_optimizer, make_schedule
from jaxcnn.sharding import get_layout


@pytest.fixture(scope="module")
def single_plain():
    return train_losses(get_layout("single"), {"data": 1}, TINY_PLAIN, steps=20)


def test_training_lowers_the_loss(single_plain):
    losses, state, _ = single_plain
    assert len(losses) == int(state.step) == 20  # one optimizer step per recorded loss
    assert losses[-5:].mean() < 0.9 * losses[:5].mean()


def test_same_seed_same_losses_other_seed_other_losses(single_plain):
    again = train_losses(get_layout("single"), {"data": 1}, TINY_PLAIN, steps=20)[0]
    np.testing.assert_array_equal(again, single_plain[0])
    other = train_losses(get_layout("single"), {"data": 1}, TINY_PLAIN, steps=20, seed=1)[0]
    assert not np.allclose(other, single_plain[0])


def test_epoch_steps_and_batch_larger_than_data():
    assert epoch_steps(100, TrainConfig(batch_size=32, epochs=3)) == [3, 3, 3]
    assert epoch_steps(100, TrainConfig(batch_size=32, epochs=3, max_steps=4)) == [3, 1]
    assert epoch_steps(100, TrainConfig(epochs=3, batch_schedule=((0, 20), (2, 50)))) == [5, 5, 2]
    with pytest.raises(UserError, match="larger than the 10 training images"):
        epoch_steps(10, TrainConfig(batch_size=32))


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd"])
def test_optimizers_apply_their_own_rule_and_cosine_schedule_warms_up_then_decays(name):
    config = OptimConfig(name=name, learning_rate=0.1, warmup_steps=10, weight_decay=0.5, momentum=0.9)
    params, grads = jnp.array([2.0, -4.0]), jnp.array([0.5, -3.0])
    tx = make_optimizer(config, 100)
    opt_state = tx.init(params)
    first, opt_state = tx.update(grads, opt_state, params)
    assert not np.asarray(first).any()  # the warmup starts from a learning rate of 0 ...
    updates, _ = tx.update(grads, opt_state, params)  # ... so the parameters are still `params`
    lr1 = 0.1 / 10  # step 1 of a linear warmup from 0 to 0.1 over 10 steps
    expected = {
        "adam": -lr1 * np.sign(grads),  # m / sqrt(v) of a constant gradient, bias-corrected: its sign
        "adamw": -lr1 * (np.sign(grads) + 0.5 * params),  # plus decoupled weight decay
        "sgd": -lr1 * (1 + 0.9) * grads,  # the momentum trace g + 0.9 g
    }[name]
    np.testing.assert_allclose(updates, expected, rtol=1e-5)
    schedule = make_schedule(config, 100)
    assert float(schedule(0)) == 0.0 and float(schedule(10)) == pytest.approx(0.1)
    assert float(schedule(99)) < 0.01
    constant = make_schedule(OptimConfig(schedule="constant", warmup_steps=0, learning_rate=0.1), 100)
    assert float(constant(0)) == float(constant(99)) == pytest.approx(0.1)


def test_diverged_at_names_the_first_step_far_above_the_first_loss():
    assert diverged_at([2.3, 2.5, 1.9, 22.9]) is None  # below 10x
    assert diverged_at([2.3, 2.5, 23.1, 4e6, 2.0]) == 3  # the first one over, even if it comes back
    # non-finite losses are the non-finite check's business (it stops the run, or skips the step)
    assert diverged_at([2.3, float("nan"), float("inf")]) is None
    assert diverged_at([]) is None and diverged_at([float("nan"), 1e9]) is None


def test_a_diverging_run_warns_naming_the_step_and_records_it(tmp_path, capsys):
    from conftest import load_train_module

    from jaxcnn.commands import cli

    flags = ["--conv-features", "8,16,16", "--dense-features", "32,16", "--batch-size", "32",
             "--lr", "1e6", "--max-steps", "8", "--quiet", "--results-dir", str(tmp_path), "--run-name", "big"]  # fmt: skip
    cli.run_main("train.py", lambda: load_train_module().main(flags))  # exits 0: the run finished
    captured = capsys.readouterr()
    record = json.loads((tmp_path / "big" / "big.json").read_text())
    losses, step = record["loss_history"], record["diverged_at_step"]
    assert step == next(k for k, loss in enumerate(losses, 1) if loss > 10 * losses[0]) and step > 1
    warning = [line for line in captured.err.splitlines() if "diverged" in line]
    assert len(warning) == 1 and warning[0].startswith("train.py: warning: training diverged:"), captured.err
    assert f"10x step 1's ({losses[0]:.4g}) at step {step} " in warning[0]
    assert f"diverged        at step {step}" in captured.out


def test_epoch_rows_missing_from_an_older_checkpoint_are_rebuilt_from_its_histories():
    """Checkpoints saved before issue 15 could lack the row of the epoch they ended: the
    resumed run rebuilds it from the loss and accuracy histories (test figures unknown)."""
    first = {"epoch": 1, "step": 2, "train_loss": 9.0}  # as recorded: kept as it is
    resume = Resume(step=4, loss_history=[3.0, 1.0, 0.5, 0.25], accuracy_history=[0.1, 0.2, 0.6, 0.8], epochs=[first])
    rows = resume.rows([2, 2, 2], TrainConfig(batch_size=8, epochs=3))
    assert [r["epoch"] for r in rows] == [1, 2] and rows[0] is first
    assert rows[1]["step"] == 4 and rows[1]["train_loss"] == 0.375 and rows[1]["train_accuracy"] == 0.7
    assert rows[1]["test_accuracy"] is None and rows[1]["images_per_second"] is None
