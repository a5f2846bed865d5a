"""The sharding lint: the table, rules that do nothing, fallbacks, unexpected collectives."""

import dataclasses

from conftest import TINY_PLAIN, compiled_program, load_train_module

from jaxcnn.analysis.lint import format_report, lint, lint_program
from jaxcnn.build import plan_placements
from jaxcnn.config import ModelConfig
from jaxcnn.sharding import build_mesh, get_layout, parse_rules, quiet_fallbacks

ONE_BLOCK = ModelConfig(name="cnn2d_1layer_fullconnected_2layer", conv_features=(8,), dense_features=(32,), norm="none")


def placements(model, layout, mesh):
    with quiet_fallbacks():  # the fallbacks are the report's business here
        return plan_placements(model, layout, mesh, (8, 8, 1))


def test_rule_that_matches_no_name_is_reported():
    # one conv block: its channels are a conv_in space, so `conv_out` names nothing
    layout, mesh = get_layout("tp"), build_mesh({"model": 2})
    report = lint(layout, mesh, placements(ONE_BLOCK, layout, mesh))
    assert any(w.startswith("rule conv_out=model matched nothing") for w in report.warnings)
    assert not any("mlp=model" in w for w in report.warnings)


def test_rule_over_a_one_device_axis_is_reported():
    layout, mesh = get_layout("hybrid"), build_mesh({"data": 8, "model": 1})
    report = lint(layout, mesh, placements(TINY_PLAIN, layout, mesh))
    assert "rule conv_out=model does nothing on this mesh: axis 'model' has size 1" in report.warnings
    assert not any("batch=data" in w for w in report.warnings)


def test_fallbacks_are_reported_and_shown_in_the_table():
    layout, mesh = get_layout("tp"), build_mesh({"model": 3})  # widths 8, 16, 32: none divides 3
    report = lint(layout, mesh, placements(TINY_PLAIN, layout, mesh))
    fallbacks = [w for w in report.warnings if "does not divide mesh axes model=3; replicated" in w]
    assert {w.split(" dim")[0] for w in fallbacks} == {
        "blocks/0/conv/kernel", "blocks/0/conv/bias", "blocks/1/conv/kernel", "dense/0/kernel", "dense/0/bias",
        "dense/1/kernel",
    }  # fmt: skip
    text = format_report(report)
    assert "shardings for layout tp on mesh model=3" in text
    assert "blocks/1/conv/kernel  (kh, kw, conv_out, conv_in)  3x3x8x16" in text


def test_an_all_gather_of_activations_under_tp_is_flagged():
    # Split conv 1's *output* channels and nothing after it: the flatten must then gather
    # the activation whole -- the mistake column -> row pairs exist to avoid.
    wrong = dataclasses.replace(get_layout("tp"), params=(("conv_in", ("model",)),))
    with quiet_fallbacks():  # conv 0's single input channel cannot split: noted, fine
        program = compiled_program(wrong, {"model": 2}, TINY_PLAIN, steps=10)
    report = lint_program(program)
    flagged = [w for w in report.warnings if "did not expect" in w and "all-gather of activations" in w]
    assert flagged, report.warnings
    right = compiled_program(get_layout("tp"), {"model": 2}, TINY_PLAIN, steps=10)
    assert not [w for w in lint_program(right).warnings]


def test_user_tables_are_linted_for_rules_but_not_for_collectives():
    layout = parse_rules("batch=data,conv_out=model")
    program = compiled_program(layout, {"data": 4, "model": 2}, TINY_PLAIN, steps=10)
    report = lint_program(program)
    assert report.collectives and not [w for w in report.warnings if "did not expect" in w]


def test_print_shardings_flag_prints_the_table_and_the_collectives(capsys, tmp_path):
    load_train_module().main(
        ["--conv-features", "8,16", "--model", "cnn2d_2layer_fullconnected_2layer", "--dense-features", "32",
         "--batch-size", "32", "--max-steps", "2", "--quiet", "--layout", "hybrid", "--mesh", "data=4,model=2",
         "--host-devices", "8", "--print-shardings", "--results-dir", str(tmp_path)]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert "shardings for layout hybrid on mesh data=4,model=2" in out
    assert "dense/0/kernel" in out and "(-, model)" in out
    assert "collectives in the compiled train step" in out and "all-reduce" in out
