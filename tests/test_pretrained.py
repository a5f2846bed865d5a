"""--init-from: safetensors files in torchvision's, timm's and jaxcnn's names, built here with
numpy, load onto every family and write back equal; a mismatch is one line; a classifier of
another class count is re-initialised; each array lands in its layout's shards; --freeze and
--backbone-lr act on the parts they name; a resumed run does not read the file again. With
torch installed, torchvision's own models give jaxcnn's logits."""

from __future__ import annotations

import json
import subprocess

import jax
import numpy as np
import pytest
from conftest import compiled_program, initialised, load_train_module
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxcnn.commands import cli
from jaxcnn.config import ModelConfig, OptimConfig, TrainConfig
from jaxcnn.data import Dataset
from jaxcnn.errors import UserError
from jaxcnn.fit import fit
from jaxcnn.models.model_parts import part_of
from jaxcnn.models.torchvision_names import torch_shape
from jaxcnn.optim import make_optimizer
from jaxcnn.pretrained import load_pretrained, model_shapes, read_plan, save_pretrained, save_run_weights, schemes
from jaxcnn.saved_model import ModelVariables, flat_variables
from jaxcnn.sharding import build_mesh, get_layout
from jaxcnn.sharding.partition import place_variables
from jaxcnn.steps import TrainState, split_model

RESNET = ModelConfig(name="resnet18", conv_features=(4, 4, 8, 8), num_classes=5)
CONVNEXT = ModelConfig(name="convnext_test", num_classes=5)
MOBILENET = ModelConfig(name="mobilenet_v2_test", num_classes=5)
CNN = ModelConfig(name="cnn2d_2layer_fullconnected_2layer", conv_features=(8, 16), dense_features=(32,),
                  norm="batch", num_classes=5)  # fmt: skip
# (model, image shape, the file's names)
FAMILIES = {
    "resnet18": (RESNET, (32, 32, 3), "torchvision"),
    "convnext-torchvision": (CONVNEXT, (16, 16, 3), "torchvision"),
    "convnext-timm": (CONVNEXT, (16, 16, 3), "timm"),
    "mobilenet_v2": (MOBILENET, (16, 16, 3), "torchvision"),
    "cnn": (CNN, (8, 8, 1), "jaxcnn"),
}


def write_file(path, config, image_shape, scheme, seed=0, extra=None):
    """Random arrays of the shapes `scheme` gives `config`'s model, by numpy alone (variances
    positive), plus torchvision's `num_batches_tracked` where batch norms are."""
    shapes = model_shapes(config, image_shape)
    rng = np.random.default_rng(seed)
    tensors = {}
    for key, (at, how) in schemes(config, shapes)[0][scheme].items():
        shape = torch_shape(how, shapes[at])
        value = rng.random(shape) + 0.5 if at.endswith("/var") else rng.normal(0, 0.2, shape)
        tensors[key] = value.astype(np.float32)
        if key.endswith("running_var"):
            tensors[key.replace("running_var", "num_batches_tracked")] = np.array(7, np.int64)
    save_file({**tensors, **(extra or {})}, str(path))
    return {k: v for k, v in tensors.items() if not k.endswith("num_batches_tracked")}


class WholeState:
    """What load_pretrained asks of a Program: an SPMD layout's state is already the whole model's."""

    saved_form = staticmethod(lambda state: state)
    from_saved = staticmethod(lambda state: state)


def fresh(config, image_shape, layout=None, mesh=None):
    """A freshly initialised state, placed as `layout` places it on `mesh` (None: one device)."""
    _, params, stats = split_model(initialised(config, image_shape, seed=1))
    # copies: loading frees the arrays it replaces, and initialised() hands out the same ones each call
    params, stats = jax.tree.map(lambda a: jax.numpy.array(a, copy=True), (params, stats))
    if layout is not None:
        params = jax.device_put(params, place_variables(params, layout, mesh)[0])
        stats = jax.device_put(stats, place_variables(stats, layout, mesh)[0])
    return TrainState(np.int32(0), params, stats, (), np.zeros(2, np.uint32))


def written_back(state, config, scheme, path):
    save_pretrained(path, ModelVariables(flat_variables(state.params), flat_variables(state.model_state)), config,
                    scheme)  # fmt: skip
    return load_file(str(path))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_file_loads_and_writes_back_equal(tmp_path, family):
    config, image_shape, scheme = FAMILIES[family]
    tensors = write_file(tmp_path / "in.safetensors", config, image_shape, scheme)
    plan = read_plan(config, image_shape, tmp_path / "in.safetensors")
    assert plan.scheme == scheme and not plan.head_reinit
    state = load_pretrained(WholeState, fresh(config, image_shape), plan)
    back = written_back(state, config, scheme, tmp_path / "out.safetensors")
    assert back.keys() == tensors.keys()
    assert all(np.array_equal(back[k], tensors[k]) for k in tensors)


def test_a_classifier_of_another_class_count_is_reinitialised_and_said(tmp_path):
    imagenet = ModelConfig(name="resnet18", conv_features=(4, 4, 8, 8), num_classes=1000)
    tensors = write_file(tmp_path / "imagenet.safetensors", imagenet, (32, 32, 3), "torchvision")
    plan = read_plan(RESNET, (32, 32, 3), tmp_path / "imagenet.safetensors")
    assert plan.head_reinit == ("fc.weight", "fc.bias")
    assert len(plan.notes) == 1 and "not for 5 classes" in plan.notes[0] and "(1000, 8)" in plan.notes[0]
    before = fresh(RESNET, (32, 32, 3))
    head_before = np.asarray(before.params["head"]["fc"]["kernel"].get_value())
    state = load_pretrained(WholeState, before, plan)
    np.testing.assert_array_equal(state.params["head"]["fc"]["kernel"].get_value(), head_before)
    np.testing.assert_array_equal(state.params["stem"]["conv"]["kernel"].get_value(),
                                  tensors["conv1.weight"].transpose(2, 3, 1, 0))  # fmt: skip


@pytest.mark.parametrize(
    ("made_for", "message"),
    [
        (MOBILENET, "missing 'conv1.weight' (the file holds {n} tensors named like 'features.1.conv.0.0.weight': "
                    "a mobilenet_v2 file?)"),
        (ModelConfig(name="resnet34", conv_features=(4, 4, 8, 8), num_classes=5), "unexpected 'layer1.2.bn1.bias'"),
        (ModelConfig(name="resnet18", conv_features=(8, 4, 8, 8), num_classes=5),
         "'conv1.weight' is (8, 3, 3, 3) in the file, resnet18 here needs (4, 3, 3, 3)"),
    ],
)  # fmt: skip
def test_a_mismatch_is_one_line_naming_the_first_offender(tmp_path, made_for, message):
    shape = (16, 16, 3) if made_for is MOBILENET else (32, 32, 3)
    held = write_file(tmp_path / "other.safetensors", made_for, shape, "torchvision")
    with pytest.raises(UserError, match=r"^--init-from .*other\.safetensors: ") as err:
        read_plan(RESNET, (32, 32, 3), tmp_path / "other.safetensors")
    assert message.format(n=len(held)) in str(err.value) and "\n" not in str(err.value)


def test_bad_files_through_the_command_line_are_one_line_and_exit_2(tmp_path, capsys):
    held = write_file(tmp_path / "mobilenet.safetensors", MOBILENET, (16, 16, 3), "torchvision")
    (tmp_path / "text.safetensors").write_text("not a safetensors file")
    module = load_train_module()
    base = ["--model", "resnet18", "--conv-features", "4,4,8,8", "--synthetic", "32x32x3", "--num-classes", "5",
            "--max-steps", "1", "--quiet", "--results-dir", str(tmp_path), "--layout", "single"]  # fmt: skip
    for file, said in [
        ("mobilenet.safetensors", f"missing 'conv1.weight' (the file holds {len(held)} tensors"),
        ("text.safetensors", "not a readable safetensors file"),
        ("absent.safetensors", "no such file"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            cli.run_main("train.py", lambda f=file: module.main([*base, "--init-from", str(tmp_path / f)]))
        lines = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 2 and len(lines) == 1 and said in lines[0], lines


@pytest.mark.parametrize(
    ("layout", "mesh", "cuts"), [("dp", {"data": 8}, False), ("fsdp", {"data": 8}, True), ("tp", {"model": 4}, True)]
)
def test_loading_under_a_layout_gives_single_s_state_in_the_layout_s_shards(tmp_path, layout, mesh, cuts):
    config, image_shape = ModelConfig(name="resnet18", conv_features=(8, 8, 16, 16), num_classes=8), (32, 32, 3)
    write_file(tmp_path / "f.safetensors", config, image_shape, "torchvision")
    plan = read_plan(config, image_shape, tmp_path / "f.safetensors")
    single = load_pretrained(WholeState, fresh(config, image_shape), plan)
    placed_mesh = build_mesh(mesh)
    before = fresh(config, image_shape, get_layout(layout), placed_mesh)
    old = jax.tree.leaves((before.params, before.model_state))
    state = load_pretrained(WholeState, before, plan)
    assert all(leaf.is_deleted() for leaf in old)  # each fresh array freed as its replacement arrived
    for tree, want in [(state.params, single.params), (state.model_state, single.model_state)]:
        shardings = place_variables(tree, get_layout(layout), placed_mesh)[0]
        for leaf, sharding, expected in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), jax.tree.leaves(want),
                                            strict=True):  # fmt: skip
            assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
            assert {s.data.shape for s in leaf.addressable_shards} == {sharding.shard_shape(leaf.shape)}
            np.testing.assert_array_equal(leaf, expected)
    split = [leaf for leaf in jax.tree.leaves(state.params) if leaf.addressable_shards[0].data.shape != leaf.shape]
    assert bool(split) == cuts  # dp replicates every array; fsdp and tp cut some


def _parts(tree, config):
    part = part_of(config)
    return {path: part(path) for path in flat_variables(tree)}


@pytest.mark.parametrize(("layout", "mesh"), [("dp", {"data": 8}), ("pipeline", {"data": 2, "stage": 2})])
def test_freeze_keeps_the_frozen_parts_bit_identical_while_the_rest_trains(tmp_path, layout, mesh):
    """Under a pipeline too, whose chunks' optimizers see the chunks' own paths."""
    config, image_shape = CNN, (8, 8, 1)
    write_file(tmp_path / "f.safetensors", config, image_shape, "jaxcnn")
    optim = OptimConfig(name="adamw", learning_rate=1e-2, warmup_steps=2, freeze=("stage1", "dense1"))
    program = compiled_program(get_layout(layout), mesh, config, steps=4, image_shape=image_shape, optim=optim)
    start = load_pretrained(program, program.init(), read_plan(config, image_shape, tmp_path / "f.safetensors"))
    first = {k: np.asarray(v) for k, v in flat_variables(program.saved_form(start).params).items()}
    images = np.random.default_rng(0).random((64, *image_shape), np.float32)
    data = Dataset(images, (np.arange(64) % 5).astype(np.int32), "random")
    result = fit(program, start, data, None, TrainConfig(batch_size=32, epochs=1, max_steps=4), progress=False)
    whole = program.saved_form(result.state)
    last = {k: np.asarray(v) for k, v in flat_variables(whole.params).items()}
    for path, part in _parts(whole.params, config).items():
        if part in ("stage1", "dense1"):
            assert np.array_equal(last[path], first[path]), path
        else:
            assert not np.array_equal(last[path], first[path]), path


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_backbone_lr_scales_every_part_but_the_head(name):
    config = CNN
    _, params, _ = split_model(initialised(config, (8, 8, 1)))
    grads = jax.tree.map(lambda p: np.random.default_rng(p.size).normal(size=p.shape).astype(np.float32), params)
    plain = OptimConfig(name=name, learning_rate=0.1, warmup_steps=0, schedule="constant")
    slow = OptimConfig(name=name, learning_rate=0.1, warmup_steps=0, schedule="constant", backbone_lr=0.025)
    updates = {}
    for optim in (plain, slow):
        tx = make_optimizer(optim, 10, config)
        updates[optim.backbone_lr] = flat_variables(tx.update(grads, tx.init(params), params)[0])
    for path, part in _parts(params, config).items():
        want = updates[None][path] * (1.0 if part == "head" else 0.25)
        np.testing.assert_allclose(updates[0.025][path], want, rtol=1e-6, atol=1e-12)


def test_freeze_names_are_checked_against_the_model():
    with pytest.raises(UserError, match="--freeze 'stage9': resnet18's parts are stem, stage1, stage2, stage3, "
                                        "stage4, head"):  # fmt: skip
        make_optimizer(OptimConfig(freeze=("stage9",)), 10, RESNET)
    with pytest.raises(UserError, match="give it alone"):
        OptimConfig(freeze=("backbone", "head"))


def test_a_resumed_run_continues_its_checkpoint_without_the_file(tmp_path, capsys):
    config_flags = ["--conv-features", "8,16", "--dense-features", "32", "--norm", "batch", "--batch-size", "32",
                    "--quiet", "--results-dir", str(tmp_path), "--checkpoint-every", "2"]  # fmt: skip
    model = ModelConfig(name="cnn2d_2layer_fullconnected_2layer", conv_features=(8, 16), dense_features=(32,),
                        norm="batch", num_classes=1000)  # fmt: skip
    write_file(tmp_path / "f.safetensors", model, (8, 8, 1), "jaxcnn")
    module = load_train_module()
    full = module.main([*config_flags, "--model", "cnn2d_2layer_fullconnected_2layer", "--run-name", "full",
                        "--init-from", str(tmp_path / "f.safetensors"), "--freeze", "stage1",
                        "--max-steps", "4", "--checkpoint-dir", str(tmp_path / "a")])  # fmt: skip
    said = capsys.readouterr().out
    line = [line for line in said.splitlines() if "re-initialised" in line]
    assert len(line) == 1 and "dense.1.kernel" in line[0] and "dense.1.bias" in line[0]
    saved = json.loads((tmp_path / "full" / "config.json").read_text())
    assert saved["checkpoint"]["init_from"] == str(tmp_path / "f.safetensors")
    assert saved["optim"]["freeze"] == ["stage1"]
    # the finished run's weights, written back: its frozen part (parameters, not batch statistics) as the file had it
    kept = save_run_weights(tmp_path / "full", tmp_path / "full.safetensors", "jaxcnn")
    after, before = load_file(str(kept)), load_file(str(tmp_path / "f.safetensors"))
    frozen = [k for k in before if k.startswith("blocks.0.") and not k.endswith(("mean", "var"))]
    assert frozen and all(np.array_equal(after[k], before[k]) for k in frozen)
    assert not np.array_equal(after["blocks.1.conv.kernel"], before["blocks.1.conv.kernel"])
    subprocess.run(["cp", "-r", str(tmp_path / "a"), str(tmp_path / "b")], check=True)
    subprocess.run(["rm", "-rf", str(tmp_path / "b" / "4")], check=True)
    (tmp_path / "f.safetensors").unlink()  # a resumed run must not need it
    again = module.main([*config_flags, "--model", "cnn2d_2layer_fullconnected_2layer", "--run-name", "again",
                         "--init-from", str(tmp_path / "f.safetensors"), "--freeze", "stage1",
                         "--max-steps", "4", "--checkpoint-dir", str(tmp_path / "b"), "--resume"])  # fmt: skip
    assert again["resumed_from_step"] == 2 and again["loss_history"] == full["loss_history"]


def same_logits(torch, reference, state_dict, config, tmp_path, label, capsys):
    """`state_dict` through a safetensors file into jaxcnn's `config` (4 random 64x64 images):
    its logits against torch's `reference`, the figures printed; (the loaded state, the plan)."""
    save_file(state_dict, str(tmp_path / "weights.safetensors"))
    image_shape = (64, 64, 3)
    plan = read_plan(config, image_shape, tmp_path / "weights.safetensors")
    state = load_pretrained(WholeState, fresh(config, image_shape), plan)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: initialised(config, image_shape, seed=1)))
    images = np.random.default_rng(0).random((4, *image_shape), np.float32)
    forward = jax.jit(lambda params, stats, x: nnx.merge(graphdef, params, stats)(x, train=False))  # weights as inputs
    ours = np.asarray(forward(state.params, state.model_state, images))
    with torch.no_grad():
        theirs = reference(torch.from_numpy(images.transpose(0, 3, 1, 2))).numpy()
    diff = np.abs(ours - theirs)
    with capsys.disabled():
        print(f"\n{label}: logits max |diff| {diff.max():.3g}, max |diff| / |torch's| {(diff / np.abs(theirs)).max():.3g}, "
              f"max |diff| / the largest |logit| {diff.max() / np.abs(theirs).max():.3g}")  # fmt: skip
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4 * np.abs(theirs).max())
    return state, plan


# --- with torch: torchvision's own models, random weights, give jaxcnn's logits -----------------

TORCH_MODELS = {  # torchvision's builder, jaxcnn's config (torchvision's widths; the 7x7 / patch-4 stems)
    "resnet18": ("resnet18", ModelConfig(name="resnet18", num_classes=1000, stem="imagenet")),
    "convnext_tiny": ("convnext_tiny", ModelConfig(name="convnext_tiny", num_classes=1000, stem="imagenet")),
    "mobilenet_v2": ("mobilenet_v2", ModelConfig(name="mobilenet_v2", num_classes=1000, stem="imagenet")),
}


@pytest.mark.parametrize("name", sorted(TORCH_MODELS))
def test_torchvision_random_weights_give_jaxcnn_the_same_logits(tmp_path, name, capsys):  # pragma: no cover
    torch = pytest.importorskip("torch", reason="torch is not installed: the torchvision logits check needs it")
    torchvision = pytest.importorskip("torchvision", reason="torchvision is not installed")
    builder, config = TORCH_MODELS[name]
    torch.manual_seed(0)
    reference = getattr(torchvision.models, builder)().eval()
    with torch.no_grad():  # statistics and layer scales away from their initial 0, 1 and 1e-6
        for key, tensor in reference.state_dict().items():
            if key.endswith(("running_mean", "layer_scale")):
                tensor.normal_(0, 0.5)
            elif key.endswith("running_var"):
                tensor.uniform_(0.5, 2.0)
    state_dict = {k: v.numpy() for k, v in reference.state_dict().items()}
    state, _ = same_logits(torch, reference, state_dict, config, tmp_path, name, capsys)
    back = written_back(state, config, "torchvision", tmp_path / "back.safetensors")
    assert all(np.array_equal(back[k], state_dict[k]) for k in back)


def test_a_pipeline_loads_each_stage_s_arrays_on_its_own_devices(tmp_path):
    config, image_shape = CNN, (8, 8, 1)
    tensors = write_file(tmp_path / "f.safetensors", config, image_shape, "jaxcnn")
    program = compiled_program(get_layout("pipeline"), {"data": 2, "stage": 2}, config, steps=4,
                               image_shape=image_shape)  # fmt: skip
    fresh_state = program.init()
    where = [leaf.sharding for leaf in jax.tree.leaves(fresh_state)]
    state = load_pretrained(program, fresh_state, read_plan(config, image_shape, tmp_path / "f.safetensors"))
    assert [leaf.sharding for leaf in jax.tree.leaves(state)] == where  # each array where the stage holds it
    whole = program.saved_form(state)
    loaded = {**flat_variables(whole.params), **flat_variables(whole.model_state)}
    assert all(np.array_equal(loaded[key.replace(".", "/")], value) for key, value in tensors.items())


def test_local_sgd_replicas_and_stale_history_all_start_from_the_file(tmp_path):
    config, image_shape = CNN, (8, 8, 1)
    tensors = write_file(tmp_path / "f.safetensors", config, image_shape, "jaxcnn")
    state = fresh(config, image_shape)
    stacked = jax.tree.map(lambda a: jax.numpy.stack([a, a + 1]), state.params)  # two replicas (local SGD)
    history = (jax.tree.map(lambda a: a - 1, state.params),)  # staleness 1: the previous step's parameters
    state = state._replace(params=stacked, history=history)
    loaded = load_pretrained(WholeState, state, read_plan(config, image_shape, tmp_path / "f.safetensors"))
    replicas, previous = flat_variables(loaded.params), flat_variables(loaded.history[0])
    for key, value in tensors.items():
        path = key.replace(".", "/")
        if path in replicas:
            assert all(np.array_equal(replica, value) for replica in replicas[path])
            assert np.array_equal(previous[path], value)


def test_timm_s_1x1_conv_mlp_loads_as_its_linear_twin(tmp_path):
    """timm's small ConvNeXts (atto..nano, conv_mlp) hold their MLP as 1x1 convs (O, I, 1, 1)."""
    config, image_shape = CONVNEXT, (16, 16, 3)
    tensors = write_file(tmp_path / "linear.safetensors", config, image_shape, "timm")
    convs = {k: v[..., None, None] if ".mlp.fc" in k and k.endswith("weight") else v for k, v in tensors.items()}
    save_file(convs, str(tmp_path / "conv.safetensors"))
    state = load_pretrained(WholeState, fresh(config, image_shape),
                            read_plan(config, image_shape, tmp_path / "conv.safetensors"))  # fmt: skip
    back = written_back(state, config, "timm", tmp_path / "back.safetensors")
    assert any(v.ndim == 4 for k, v in convs.items() if ".mlp." in k)
    assert all(np.array_equal(back[k], tensors[k]) for k in tensors)  # written back as Linear weights


@pytest.mark.parametrize("name", ["convnext_atto", "convnext_tiny"])
def test_timm_random_weights_give_jaxcnn_the_same_logits(tmp_path, name, capsys):  # pragma: no cover
    torch = pytest.importorskip("torch", reason="torch is not installed: the timm logits check needs it")
    timm = pytest.importorskip("timm", reason="timm is not installed: the timm logits check needs it")
    torch.manual_seed(0)
    reference = timm.create_model(name, pretrained=False).eval()  # atto: a 1x1-conv MLP; tiny: Linear
    with torch.no_grad():
        for key, tensor in reference.state_dict().items():
            if key.endswith("gamma"):  # layer scale away from its initial 1e-6
                tensor.normal_(0, 0.5)
    config = ModelConfig(name=name, num_classes=1000, stem="imagenet")
    state_dict = {k: v.numpy() for k, v in reference.state_dict().items()}
    _, plan = same_logits(torch, reference, state_dict, config, tmp_path, f"timm {name}", capsys)
    assert plan.scheme == "timm"
