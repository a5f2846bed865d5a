"""The loop at the devices' pace (jaxcnn.data.on_device, jaxcnn.steps.calls): data held on
the devices gives the host loader's examples in its order, K steps in one call are K single
steps, augmentation drawn in the step does not depend on the layout, and a stop, a resume
and a non-finite loss land where they would one step a call."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, TINY_PLAIN, _optim, bundled_digits, compiled_program, load_train_module
from test_equivalence import layout_named

from jaxcnn.build import build_program
from jaxcnn.config import TrainConfig
from jaxcnn.data import Augment, Loader
from jaxcnn.data.on_device import choose, placed
from jaxcnn.fit import fit
from jaxcnn.sharding import build_mesh

STEPS = 10
TINY = ["--conv-features", "8,16,16", "--dense-features", "32,16", "--batch-size", "32", "--quiet"]


def trained(layout_name, mesh_shape, on_device=True, per_call=1, augment=None, steps=STEPS, seed=0):
    """(the run's FitResult, the program): `steps` steps on the bundled digits, the data on
    the devices or read by the host loader, `per_call` steps a call."""
    data, augment = bundled_digits(), augment or Augment()
    layout, mesh = layout_named(layout_name), build_mesh(mesh_shape)
    on, _ = choose("on" if on_device else "off", data, layout, mesh, augment, seed)
    if on is None and per_call == 1 and augment == Augment():
        program = compiled_program(layout, mesh_shape, TINY_PLAIN, steps, 32, seed, data.image_shape)
    else:
        program = build_program(
            TINY_PLAIN, _optim(), layout, mesh, data.image_shape, 32, steps, seed=seed, with_eval=False,
            on_device=on, steps_per_call=per_call,
        )  # fmt: skip
    config = TrainConfig(batch_size=32, epochs=1, max_steps=steps, seed=seed, steps_per_call=per_call)
    result = fit(
        program, program.init(), Loader(data, augment=augment), None, config, progress=False,
        device_data=placed(data, on, layout, mesh) if on else None,
    )  # fmt: skip
    return result, program


def losses(layout_name, mesh_shape, on_device=True, per_call=1, augment=None, steps=STEPS, seed=0):
    """(per-step losses, the program) of `trained`'s run."""
    result, program = trained(layout_name, mesh_shape, on_device, per_call, augment, steps, seed)
    return np.asarray(result.loss_history), program


def assert_same_state(state, expected, rtol=1e-6):
    """Every leaf of two TrainStates (the step count, parameters, optimizer state) alike."""
    leaves, expected_leaves = (jax.tree.leaves(jax.device_get(s)) for s in (state, expected))
    assert len(leaves) == len(expected_leaves)
    for a, b in zip(leaves, expected_leaves, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=1e-7)


@pytest.mark.parametrize(
    ("layout_name", "mesh"),
    [("single", {"data": 1}), ("dp", {"data": 8}), ("fsdp", {"data": 8}), ("tp", {"model": 4}),
     ("hybrid", {"data": 4, "model": 2}), ("spatial", {"data": 2, "spatial": 4})],
    ids=lambda v: v if isinstance(v, str) else ",".join(f"{k}={n}" for k, n in v.items()),
)  # fmt: skip
def test_data_on_the_devices_and_k_steps_a_call_give_the_host_loaders_losses_on_every_layout(layout_name, mesh):
    """The step gathers the examples the host loader would have read, in its order, 3 steps
    a call (the last of the 4 calls runs exactly its 1 step: the 1-step call is always
    compiled): without augmentation every loss equals the host path's one step a call."""
    host, _ = losses(layout_name, mesh, on_device=False)
    device, program = losses(layout_name, mesh, on_device=True, per_call=3)
    assert program.calls.ready(3, True) and len(device) == STEPS  # the run took the on-device call
    np.testing.assert_allclose(device, host, rtol=1e-6, atol=0)
    on, _ = choose("on", bundled_digits(), layout_named(layout_name), build_mesh(mesh), Augment(), 0)
    assert on.dtype == "uint8" and on.scale == 16  # the digits' x / 16 kept as bytes: a quarter of the memory


@pytest.mark.parametrize("on_device", [True, False], ids=["device", "host"])
def test_k_steps_in_one_call_equal_k_single_calls(on_device):
    """4 steps a call over 10 steps against the host loader's one step a call: the same
    losses, and the same state after. On the devices the run's last call is the 4-step call
    with only 2 steps in the run (a 2-step call is compiled ahead only for a later epoch):
    its 2 idle steps leave the state as the 10 real steps left it."""
    one, _ = trained("dp", {"data": 8}, on_device=False)
    four, program = trained("dp", {"data": 8}, on_device=on_device, per_call=4)
    assert program.calls.ready(4, on_device) and program.calls.get(4, on_device).stacked  # all 4 losses back
    if on_device:
        assert not program.calls.ready(2, True)  # so the last call held 2 idle steps
    np.testing.assert_allclose(four.loss_history, one.loss_history, rtol=1e-6)
    assert int(four.state.step) == STEPS
    assert_same_state(four.state, one.state)


def test_an_epochs_last_call_runs_exactly_its_steps_once_compiled():
    """Epochs of 4 steps (batch 320), 3 steps a call, 3 epochs: each epoch's last call is the
    1-step call (compiled here first, as the loop compiles it ahead), and every loss is the
    host loader's one step a call -- the next epoch's rows, placed while the last call runs,
    included."""
    from jaxcnn.program import StepCall

    data, layout, mesh = bundled_digits(), layout_named("dp"), build_mesh({"data": 2})
    on, _ = choose("on", data, layout, mesh, Augment(), 0)
    programs = {
        where: build_program(TINY_PLAIN, _optim(), layout, mesh, data.image_shape, 320, 12, with_eval=False,
                             on_device=on, steps_per_call=3 if where == "device" else 1)
        for where in ("device", "host")
    }  # fmt: skip
    program = programs["device"]
    exact = program.calls.get(1, True)
    runs = []
    program.calls._calls[(1, True)] = StepCall(lambda *a: runs.append(1) or exact.run(*a), 1, True)
    config = TrainConfig(batch_size=320, epochs=3, steps_per_call=3)
    device = fit(program, program.init(), Loader(data), None, config, progress=False,
                 device_data=placed(data, on, layout, mesh))  # fmt: skip
    host = fit(programs["host"], programs["host"].init(), Loader(data), None, TrainConfig(batch_size=320, epochs=3),
               progress=False)  # fmt: skip
    assert len(runs) == 3  # one a epoch: its 4th step
    np.testing.assert_allclose(device.loss_history, host.loss_history, rtol=1e-6)
    assert len(device.loss_history) == 12


def test_shift_and_flip_drawn_in_the_step_do_not_depend_on_the_layout():
    augment = Augment(shift=2, flip=True)
    single, _ = losses("single", {"data": 1}, augment=augment)
    dp, _ = losses("dp", {"data": 8}, augment=augment)
    hybrid, _ = losses("hybrid", {"data": 4, "model": 2}, augment=augment)
    plain, _ = losses("dp", {"data": 8})
    np.testing.assert_allclose(dp, single, rtol=1e-5)
    np.testing.assert_allclose(hybrid, single, rtol=1e-5)
    assert not np.allclose(dp, plain, rtol=1e-3)  # the images really were shifted and flipped


def test_each_steps_shift_and_flip_on_the_devices_are_drawn_from_its_own_key():
    """The images each step of a call trains on (recorded by a step that keeps them) are its
    examples, shifted and flipped as a host-side draw from that step's key -- (seed, epoch,
    batch index) folded in, as documented -- gives: no two steps share a draw."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxcnn.data.on_device import batch_axes
    from jaxcnn.steps.calls import steps_on_device_data

    seed, epoch, shift, per_call, batch, steps = 3, 5, 2, 3, 8, 6
    data, layout, mesh = bundled_digits(), layout_named("dp"), build_mesh({"data": 2})
    on, _ = choose("on", data, layout, mesh, Augment(shift=shift, flip=True), seed)
    indices = np.random.default_rng(0).choice(len(data), (steps, batch), replace=False)
    rows = np.zeros((2 * steps, batch + 3), np.int32)  # as jaxcnn.data.on_device.epoch_rows lays them out
    where = np.stack([np.full(steps, epoch), np.arange(steps), np.full(steps, steps)], axis=1)  # epoch, index, steps
    rows[:steps] = np.concatenate([indices, where], axis=1)

    def record(state, images, labels):  # a "train step" that keeps the images it was given
        seen = jax.lax.dynamic_update_index_in_dim(state["seen"], images, state["at"], 0)
        return {"seen": seen, "at": state["at"] + 1}, {"loss": jnp.zeros((), jnp.float32)}

    split = NamedSharding(mesh, P("data"))
    call = jax.jit(steps_on_device_data(record, per_call, mesh, batch_axes(layout, mesh), on, split, split))
    state = {"seen": jnp.zeros((steps, batch, *data.image_shape), jnp.float32), "at": jnp.int32(0)}
    carry = {"row": jnp.int32(0), "log": {"loss": jnp.zeros(2 * steps, jnp.float32)}}
    for _ in range(steps // per_call):
        state, carry = call(state, *placed(data, on, layout, mesh), rows, carry)
    seen, draws = np.asarray(state["seen"]), set()
    height, width = data.image_shape[:2]
    for r in range(steps):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), epoch), r)
        shift_key, flip_key = jax.random.split(key)
        dy, dx = np.asarray(jax.random.randint(shift_key, (2, batch), 0, 2 * shift + 1))
        mirrored = np.asarray(jax.random.bernoulli(flip_key, 0.5, (batch,)))
        padded = np.pad(data.images[indices[r]], ((0, 0), (shift, shift), (shift, shift), (0, 0)))
        expected = np.stack([padded[b, dy[b] : dy[b] + height, dx[b] : dx[b] + width] for b in range(batch)])
        expected = np.where(mirrored[:, None, None, None], expected[:, :, ::-1], expected)
        np.testing.assert_array_equal(seen[r], expected, err_msg=f"step {r}'s images")
        draws.add((*dy, *dx, *mirrored))
    assert len(draws) == steps


def _train(tmp_path, name, *flags):
    return load_train_module().main([*TINY, "--results-dir", str(tmp_path), "--run-name", name, *flags])


RESUME_SEED = 0  # draws the checkpoint a kill leaves newest (a failure reruns the same one)


@pytest.mark.parametrize("on_device", ["on", "off"], ids=["device", "host"])
def test_resume_with_k_steps_a_call_from_a_random_checkpoint_is_exact(tmp_path, on_device):
    """4 steps a call, a checkpoint at the first call boundary past each multiple of 5: a
    run killed after some checkpoint (drawn at random from a fixed seed) leaves it the
    newest; a resume from it restarts the feed -- the device feed's carry, or the host
    loader's stacked calls -- at its step, mid-epoch: every loss as uninterrupted, bit for
    bit."""
    import random

    flags = ["--data-on-device", on_device, "--steps-per-call", "4", "--augment-shift", "1", "--max-steps", "30"]
    full = _train(tmp_path, "full", *flags, "--checkpoint-dir", str(tmp_path / "a"), "--checkpoint-every", "5",
                  "--keep-checkpoints", "10")  # fmt: skip
    saved = sorted(int(p.name) for p in (tmp_path / "a").iterdir() if p.name.isdigit())
    assert saved == [8, 12, 16, 20, 28, 30] and full["steps_per_call"] == 4  # 8: past 5, ...; 30: the end
    killed_after = random.Random(RESUME_SEED).choice(saved[:-1])
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    for later in saved:
        if later > killed_after:
            shutil.rmtree(tmp_path / "b" / str(later))
    resumed = _train(tmp_path, "again", *flags, "--checkpoint-dir", str(tmp_path / "b"), "--resume",
                     "--keep-checkpoints", "10")  # fmt: skip
    assert resumed["resumed_from_step"] == killed_after
    assert resumed["loss_history"] == full["loss_history"]  # bit for bit
    record = json.loads((tmp_path / "full" / "full.json").read_text())
    assert record["data_on_device"].startswith(on_device)


def test_a_non_finite_loss_is_caught_within_a_call_and_nothing_after_it_is_saved(tmp_path, capsys):
    from jaxcnn.checkpoint import Checkpointer
    from jaxcnn.commands import cli

    flags = ["--optimizer", "sgd", "--momentum", "0", "--lr", "1e30", "--schedule", "constant", "--warmup-steps", "0",
             "--norm", "none", "--max-steps", "12", "--data-on-device", "on", "--steps-per-call", "4"]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        cli.run_main(
            "train.py",
            lambda: _train(tmp_path, "nan", *flags, "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "1"),
        )
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "training loss is nan at step 2; stopped" in error[0], error
    assert Checkpointer(tmp_path / "ck", every=1).steps() == []  # the first call's state followed the nan


@pytest.mark.parametrize(
    ("per_call", "batch", "polled"), [(1, 16, True), (4, 16, True), (4, 64, False)],
    ids=["1-a-call", "4-a-call", "epochs-shorter-than-a-fetch-never-ready"],
)  # fmt: skip
def test_a_non_finite_loss_stops_the_run_within_its_documented_bound(per_call, batch, polled, monkeypatch):
    """The loop never waits for metrics while the devices keep up, yet a NaN (from step 2,
    at a learning rate of 1e30) stops the run having dispatched at most 2 x 64 steps plus
    four calls past it -- the bound docs/performance-and-gpu.md promises, written here as
    the docs write it, not read from the code under test. Also
    where no fetch is ever seen ready before it must be read (as with several processes,
    or devices far behind) and every epoch (22 steps) ends before a fetch's worth of
    steps: each epoch's end starts a fetch of its own, which must still be read in time."""
    import re

    import jaxcnn.fit.metrics
    from jaxcnn.config import OptimConfig
    from jaxcnn.fit import NonFiniteLoss
    from jaxcnn.program import StepCall

    if not polled:
        monkeypatch.setattr(jaxcnn.fit.metrics.Fetch, "ready", lambda self: False)
    data, layout, mesh = bundled_digits(), layout_named("single"), build_mesh({"data": 1})
    on, _ = choose("on", data, layout, mesh, Augment(), 0)
    optim = OptimConfig(name="sgd", learning_rate=1e30, schedule="constant", warmup_steps=0, momentum=0)
    program = build_program(TINY_PLAIN, optim, layout, mesh, data.image_shape, batch, 400, with_eval=False,
                            on_device=on, steps_per_call=per_call)  # fmt: skip
    dispatched = []
    for steps in {per_call, (len(data) // batch) % per_call or per_call}:  # (an epoch's last call)
        call = program.calls.get(steps, True)

        def counted(*args, call=call):
            dispatched.append(call.steps)
            return call.run(*args)

        program.calls._calls[(steps, True)] = StepCall(counted, steps, True, call.stacked)
    config = TrainConfig(batch_size=batch, epochs=400 * batch // len(data), steps_per_call=per_call)
    with pytest.raises(NonFiniteLoss) as stopped:
        fit(program, program.init(), Loader(data), None, config, progress=False,
            device_data=placed(data, on, layout, mesh))  # fmt: skip
    first_bad = int(re.search(r"at step (\d+)", str(stopped.value)).group(1))
    assert first_bad <= 2
    documented_steps = 64  # docs/performance-and-gpu.md: "noticed within 2 x 64 steps plus four calls"
    assert first_bad < sum(dispatched) <= first_bad + 2 * documented_steps + 4 * per_call


def test_epochs_whose_end_waits_for_nothing_still_give_every_row_in_order():
    """With the data on the device and no test set an epoch's end does not wait for the
    devices: its row is filled in once its metrics arrive. Every epoch still gets its row,
    in order, once, to `on_epoch` and in the result, its loss the mean of its own steps'."""
    data, layout, mesh = bundled_digits(), layout_named("single"), build_mesh({"data": 1})
    on, _ = choose("on", data, layout, mesh, Augment(), 0)
    program = build_program(TINY_PLAIN, _optim(), layout, mesh, data.image_shape, 128, 60, with_eval=False,
                            on_device=on)  # fmt: skip
    seen = []
    result = fit(
        program, program.init(), Loader(data), None, TrainConfig(batch_size=128, epochs=5), progress=False,
        device_data=placed(data, on, layout, mesh), on_epoch=lambda row, losses: seen.append((dict(row), list(losses))),
    )  # fmt: skip
    steps = len(data) // 128
    assert [row["epoch"] for row, _ in seen] == [row["epoch"] for row in result.epochs] == [1, 2, 3, 4, 5]
    for k, (row, losses) in enumerate(seen):
        assert losses == result.loss_history[k * steps : (k + 1) * steps]
        assert row["step"] == (k + 1) * steps and row["train_loss"] == pytest.approx(np.mean(losses), rel=1e-6)
        assert row == result.epochs[k]


def test_k_larger_than_an_epoch_is_cut_to_the_epoch(tmp_path):
    """--steps-per-call 64 with epochs of 4 steps (batch 320): calls of 4, every step run."""
    run = _train(tmp_path, "long", "--data-on-device", "on", "--steps-per-call", "64", "--batch-size", "320",
                 "--max-steps", "6")  # fmt: skip
    assert run["steps_per_call"] == 4 and len(run["loss_history"]) == 6


class _Saves:
    """A checkpointer that keeps what it is given in memory: the steps saved, and whether
    each saved state was finite."""

    directory = "memory"

    def __init__(self, every: int):
        self.every, self.saved = every, []

    def save(self, step, state, record):
        finite = all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(jax.device_get(state.params)))
        self.saved.append((step, finite))

    def steps(self):
        return [step for step, _ in self.saved]


def _tiny_program(on_device: bool, batch: int, per_call: int, total: int, with_eval: bool = False, optim=None):
    """(program, device data or None) on one device, the bundled digits."""
    data, layout, mesh = bundled_digits(), layout_named("single"), build_mesh({"data": 1})
    on = choose("on", data, layout, mesh, Augment(), 0)[0] if on_device else None
    program = build_program(TINY_PLAIN, optim or _optim(), layout, mesh, data.image_shape, batch, total,
                            with_eval=with_eval, on_device=on, steps_per_call=per_call)  # fmt: skip
    return program, (placed(data, on, layout, mesh) if on else None)


def _wrap_calls(program, on_device: bool, per_call: int, epoch: int, wrap) -> None:
    """Every call the run can make -- K steps, an epoch's last (compiled here first, so that
    none appears unwrapped), one step -- replaced by `wrap(run)`."""
    from jaxcnn.program import StepCall

    if not on_device:
        program.train_step = wrap(program.train_step)
    for steps in {per_call, epoch % per_call or per_call, 1} if on_device else {per_call} - {1}:
        call = program.calls.get(steps, on_device)
        program.calls._calls[(steps, on_device)] = StepCall(wrap(call.run), steps, on_device, call.stacked)


@pytest.mark.parametrize("on_device", [True, False], ids=["device", "host"])
def test_the_stop_is_asked_once_a_call_whatever_the_actions_waited_for(on_device, monkeypatch):
    """Several processes stop at the same step only if each asks `stop.check()` (JAX's sync
    point) at the same places. Counted here against the calls dispatched, two ways: with no
    action and every metrics fetch found ready at once (a single process that never
    waits), and with everything that waits -- a checkpoint every 3 steps, an evaluation
    every epoch, a callback every 2 steps that blocks on the state, no fetch ever found
    ready (as with several processes). Both must ask exactly once after every call, the
    same sequence; and a stop agreed at the 5th question lands at the same step for both,
    saved once there."""
    import signal

    import jaxcnn.fit.metrics
    from jaxcnn.data import load_csv
    from jaxcnn.fit import Interrupted, StepCallback
    from jaxcnn.stopping import StopRequests

    class CountedStop(StopRequests):
        def __init__(self, events, agree_at=None):
            super().__init__(multi_process=False)
            self.events, self.agree_at = events, agree_at

        def check(self):
            self.events.append("check")
            if self.events.count("check") == self.agree_at:
                self.received.append(signal.SIGTERM)
            return super().check()

    per_call, batch, epochs = 3, 320, 3  # epochs of 4 steps: a call of 3, then one of the step left
    program, device_data = _tiny_program(on_device, batch, per_call, 12, with_eval=True)
    events = []

    def counted(run):
        def call(*args):
            events.append("call")
            return run(*args)

        return call

    _wrap_calls(program, on_device, per_call, 4, counted)
    test_set = load_csv(REPO / "data/test.csv")

    def run(waits: bool, agree_at=None):
        events.clear()
        monkeypatch.setattr(jaxcnn.fit.metrics.Fetch, "ready", lambda self: not waits)
        saves = _Saves(every=3) if waits else None
        try:
            result = fit(
                program, program.init(), Loader(bundled_digits()), test_set if waits else None,
                TrainConfig(batch_size=batch, epochs=epochs, steps_per_call=per_call), progress=False,
                checkpointer=saves, stop=CountedStop(events, agree_at), device_data=device_data,
                on_steps=StepCallback(2, lambda step, state: jax.block_until_ready(state)) if waits else None,
            )  # fmt: skip
        except Interrupted as stopped:
            result = stopped.result
        return list(events), result, saves

    quiet, _, _ = run(waits=False)
    busy, _, saves = run(waits=True)
    assert quiet == ["call", "check"] * 6  # 2 calls an epoch, each followed by one question
    assert busy == quiet
    assert saves.steps() == [3, 7, 11, 12]  # the first call boundary past each multiple of 3, and the end
    stopped_quiet, result_quiet, _ = run(waits=False, agree_at=5)
    stopped_busy, result_busy, saves = run(waits=True, agree_at=5)
    assert stopped_quiet == stopped_busy == ["call", "check"] * 5
    assert result_quiet.steps == result_busy.steps == 4 + 4 + 3
    assert saves.steps() == [3, 7, 11]  # the stop's one save at the agreed step (the periodic one not asked)


@pytest.mark.parametrize(
    ("on_device", "saves_every"), [(True, None), (True, 5), (True, 30), (False, 5)],
    ids=["device-rows-deferred", "device-saving", "device-first-save-after-the-nan", "host-saving"],
)  # fmt: skip
def test_a_nan_later_in_the_run_publishes_the_rows_before_it_once_in_order_and_saves_nothing_after(
    on_device, saves_every, monkeypatch
):
    """A NaN from step 27 (epoch 3 of 11-step epochs, 4 steps a call): every parameter made
    NaN by the call that starts at step 26, so step 27's loss is the first non-finite one.
    The run must raise NonFiniteLoss naming step 27, having handed `on_epoch` epochs 1 and
    2 -- once each, in order, with their own finite losses -- and nothing of epoch 3 or
    later. With the data on the devices and no test set the rows wait for their metrics
    (no fetch is ever found ready here: they arrive only when due), so the NaN is read
    epochs later; with periodic saves every save before the NaN is read must be of a step
    before it, and finite. A first save due at step 30 reads every metric first: epochs
    1 and 2's rows are completed by that read, which then finds the NaN -- they must
    still be handed on, before the error."""
    import re

    import jaxcnn.fit.metrics
    from jaxcnn.fit import NonFiniteLoss

    per_call, batch, first_bad = 4, 128, 27
    epoch = len(bundled_digits()) // batch  # 11
    program, device_data = _tiny_program(on_device, batch, per_call, 40 * epoch)
    monkeypatch.setattr(jaxcnn.fit.metrics.Fetch, "ready", lambda self: False)

    @jax.jit
    def poisoned(state):
        nan = state.step >= first_bad - 1
        return state._replace(params=jax.tree.map(lambda p: jnp.where(nan, jnp.nan, p), state.params))

    _wrap_calls(program, on_device, per_call, epoch, lambda run: lambda state, *inputs: run(poisoned(state), *inputs))
    seen, saves = [], _Saves(saves_every) if saves_every else None
    with pytest.raises(NonFiniteLoss) as stopped:
        fit(program, program.init(), Loader(bundled_digits()), None,
            TrainConfig(batch_size=batch, epochs=40, steps_per_call=per_call), progress=False, checkpointer=saves,
            device_data=device_data, on_epoch=lambda row, losses: seen.append((dict(row), list(losses))))  # fmt: skip
    assert int(re.search(r"at step (\d+)", str(stopped.value)).group(1)) == first_bad
    assert [row["epoch"] for row, _ in seen] == [1, 2]
    for k, (row, losses) in enumerate(seen):
        assert row["step"] == (k + 1) * epoch and len(losses) == epoch and np.isfinite(losses).all()
        assert row["train_loss"] == pytest.approx(np.mean(losses), rel=1e-6)
    if saves is not None:
        assert all(step < first_bad and finite for step, finite in saves.saved), saves.saved
        last_good = f"the last good checkpoint is step {saves.steps()[-1]} " if saves.saved else "no checkpoint was saved"
        assert last_good in str(stopped.value)
        assert bool(saves.saved) == (saves_every < first_bad)
