"""Config inheritance (``_base_``, ``_delete_``): merge order, nested and shared bases,
relative paths, replacement, and one-line errors naming the chain of files."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from trainrun.runner.config import ConfigError, load_config, read_config

REPO = Path(__file__).resolve().parents[2]
DATA = "data:\n  train: {type: digits}\n"
MINIMAL = "model: {type: digits_mlp}\n" + DATA


def files(folder: Path, **texts: str) -> Path:
    """Write ``name=text`` files under ``folder`` (``__`` in a name is a ``/``)."""
    for name, text in texts.items():
        path = folder / (name.replace("__", "/") + ".yaml")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return folder


def merged(path: Path) -> dict:
    """The file merged over its bases, before resolution and validation."""
    return OmegaConf.to_container(read_config(path), resolve=False)


def error(path: Path, overrides=()) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(path, overrides)
    message = str(caught.value)
    assert "\n" not in message, message
    return message


# ---------------------------------------------------------------- merging

def test_the_naming_files_keys_win_and_sections_merge_key_by_key(tmp_path):
    files(tmp_path, base="optim: {type: SGD, lr: 0.1, weight_decay: 0.01}\nprecision: bf16\n",
          run="_base_: base.yaml\noptim: {lr: 0.5}\n" + MINIMAL)
    assert merged(tmp_path / "run.yaml")["optim"] == {"type": "SGD", "lr": 0.5,
                                                       "weight_decay": 0.01}
    cfg = load_config(tmp_path / "run.yaml")
    assert (cfg.optim.type, cfg.optim.lr, cfg.optim.weight_decay) == ("SGD", 0.5, 0.01)
    assert cfg.precision == "bf16"


def test_a_list_of_bases_merges_in_order_the_later_winning(tmp_path):
    files(tmp_path, a="optim: {type: SGD, lr: 0.1}\nprecision: bf16\n",
          b="optim: {lr: 0.2}\nprecision: fp16\n",
          run="_base_: [a.yaml, b.yaml]\nprecision: fp32\n" + MINIMAL)
    cfg = load_config(tmp_path / "run.yaml")
    assert (cfg.optim.type, cfg.optim.lr, cfg.precision) == ("SGD", 0.2, "fp32")


def test_bases_of_bases_with_paths_relative_to_the_file_that_names_them(tmp_path):
    files(tmp_path,
          shared__runtime="precision: bf16\nrandomness: {seed: 7}\n",
          shared__models__mlp="_base_: ../runtime.yaml\nmodel: {type: DigitsMLP, hidden: 8}\n",
          configs__data="data:\n  train: {type: digits, batch_size: 4}\n",
          configs__run="_base_: [../shared/models/mlp.yaml, data.yaml]\nrandomness: {seed: 9}\n")
    cfg = load_config(tmp_path / "configs" / "run.yaml")
    assert (cfg.precision, cfg.randomness.seed) == ("bf16", 9)
    assert (cfg.model.hidden, cfg.data.train.batch_size) == (8, 4)


def test_interpolations_resolve_across_the_merged_files(tmp_path):
    files(tmp_path,
          data="data:\n  train: {type: digits, val_fraction: 0.2}\n"
               "  val: {type: digits, split: val, val_fraction: '${data.train.val_fraction}'}\n",
          run="_base_: data.yaml\nmodel: {type: digits_mlp}\n"
              "data: {train: {val_fraction: 0.3}}\n")
    assert merged(tmp_path / "run.yaml")["data"]["val"]["val_fraction"] == \
        "${data.train.val_fraction}"
    assert load_config(tmp_path / "run.yaml").data.val.val_fraction == 0.3


def test_name_defaults_to_the_stem_of_the_file_given_not_a_bases(tmp_path):
    files(tmp_path, base="work_dir: runs/${name}\n" + MINIMAL, run="_base_: base.yaml\n")
    cfg = load_config(tmp_path / "run.yaml")
    assert (cfg.name, cfg.work_dir) == ("run", "runs/run")


def test_delete_replaces_the_inherited_section_at_any_depth(tmp_path):
    files(tmp_path,
          base="model: {type: DigitsMLP, hidden: 8, dropout: 0.5}\n"
               "strategy: {type: fsdp, wrap: {classes: [Linear], min_params: 10}}\n"
               "data:\n  train: {type: digits, batch_size: 4}\n",
          run="_base_: base.yaml\nmodel: {_delete_: true, type: DigitsMLP}\n"
              "strategy: {wrap: {_delete_: true, min_params: 100}}\n")
    out = merged(tmp_path / "run.yaml")
    assert out["model"] == {"type": "DigitsMLP"}
    assert out["strategy"] == {"type": "fsdp", "wrap": {"min_params": 100}}
    assert "_delete_" not in str(OmegaConf.to_container(load_config(tmp_path / "run.yaml")))


def test_delete_false_merges_and_markers_never_reach_the_config(tmp_path):
    files(tmp_path, base="model: {type: DigitsMLP, hidden: 8}\n" + DATA,
          run="_base_: base.yaml\nmodel: {_delete_: false, dropout: 0.2}\n"
              "optim: {type: SGD, per_module: {net: {_delete_: true, lr: 0.1}}}\n"
              "logging: {backends: [{_delete_: false}]}\n")
    out = merged(tmp_path / "run.yaml")
    assert out["model"] == {"type": "DigitsMLP", "hidden": 8, "dropout": 0.2}
    assert out["optim"]["per_module"] == {"net": {"lr": 0.1}}
    assert out["logging"] == {"backends": [{}]}  # a marker inside a list goes too


def test_delete_in_a_later_base_replaces_what_an_earlier_base_gave(tmp_path):
    files(tmp_path, a="schedule: {max_epochs: 20, val_interval: 1}\n",
          b="schedule: {_delete_: true, max_iters: 200, val_interval: 100}\n",
          run="_base_: [a.yaml, b.yaml]\n" + MINIMAL)
    assert merged(tmp_path / "run.yaml")["schedule"] == {"max_iters": 200, "val_interval": 100}


def test_a_base_two_files_share_is_merged_once_where_first_reached(tmp_path):
    """runtime.yaml sets precision; a.yaml changes it; b.yaml builds on runtime.yaml too, but
    does not bring runtime's value back over a's."""
    files(tmp_path, runtime="precision: fp16\nrandomness: {seed: 1}\n",
          a="_base_: runtime.yaml\nprecision: bf16\n",
          b="_base_: runtime.yaml\nrandomness: {deterministic: true}\n",
          run="_base_: [a.yaml, b.yaml]\n" + MINIMAL)
    cfg = load_config(tmp_path / "run.yaml")
    assert cfg.precision == "bf16"
    assert (cfg.randomness.seed, cfg.randomness.deterministic) == (1, True)


def test_a_value_of_another_kind_replaces_the_inherited_one(tmp_path):
    files(tmp_path, base="model: {type: DigitsMLP, layers: {a: 1}, names: [x]}\n",
          run="_base_: base.yaml\nmodel: {layers: [1, 2], names: {y: 1}}\n")
    assert merged(tmp_path / "run.yaml")["model"] == {"type": "DigitsMLP", "layers": [1, 2],
                                                      "names": {"y": 1}}


def test_overrides_apply_over_the_merged_config(tmp_path):
    files(tmp_path, base="optim: {type: SGD, lr: 0.1}\n" + MINIMAL, run="_base_: base.yaml\n")
    cfg = load_config(tmp_path / "run.yaml", ["optim.lr=0.3"])
    assert (cfg.optim.type, cfg.optim.lr) == ("SGD", 0.3)


# ---------------------------------------------------------------- errors

def test_a_missing_base_names_the_chain(tmp_path):
    files(tmp_path, sub__mid="_base_: [../ok.yaml, nope.yaml]\n", ok="precision: fp32\n",
          run="_base_: sub/mid.yaml\n" + MINIMAL)
    message = error(tmp_path / "run.yaml")
    assert message == f"_base_: {tmp_path}/run.yaml -> {tmp_path}/sub/mid.yaml -> " \
                      f"{tmp_path}/sub/nope.yaml: base config not found"


@pytest.mark.parametrize("texts, chain", [
    ({"run": "_base_: run.yaml\n"}, "run.yaml -> run.yaml"),
    ({"run": "_base_: a.yaml\n", "a": "_base_: [ok.yaml, b.yaml]\n", "ok": "",
      "b": "_base_: a.yaml\n"}, "run.yaml -> a.yaml -> b.yaml -> a.yaml"),
    ({"run": "_base_: a.yaml\n", "a": "_base_: ../x/run.yaml\n"}, "run.yaml -> a.yaml -> run.yaml"),
], ids=["itself", "three files", "through a parent folder"])
def test_a_cycle_names_the_chain(tmp_path, texts, chain):
    root = tmp_path / "x"
    files(root, **texts)
    message = error(root / "run.yaml")
    assert message.startswith("_base_: cycle: ")
    names = [Path(name).name for name in message.removeprefix("_base_: cycle: ").split(" -> ")]
    assert " -> ".join(names) == chain


@pytest.mark.parametrize("text, kind", [("- a\n- b\n", "ListConfig"), ("null\n", None)])
def test_a_base_that_is_not_a_mapping_names_the_chain(tmp_path, text, kind):
    files(tmp_path, base=text, run="_base_: base.yaml\n" + MINIMAL)
    if kind is None:  # an empty mapping, as an empty file: nothing to inherit
        assert load_config(tmp_path / "run.yaml").name == "run"
        return
    assert error(tmp_path / "run.yaml") == (
        f"_base_: {tmp_path}/run.yaml -> {tmp_path}/base.yaml: got a {kind} at the top level, "
        f"expected a mapping of keys")


def test_a_yaml_error_in_a_base_names_that_base_and_its_line(tmp_path):
    files(tmp_path, base="precision: fp32\nmodel: {type: DigitsMLP\n",
          run="_base_: base.yaml\n" + MINIMAL)
    message = error(tmp_path / "run.yaml")
    assert message.startswith(f"_base_: {tmp_path}/run.yaml -> {tmp_path}/base.yaml:3: "), message


def test_python_tags_in_a_base_are_refused_and_never_run(tmp_path):
    marker = tmp_path / "pwned"
    files(tmp_path, base=f"name: !!python/object/apply:os.system ['touch {marker}']\n",
          run="_base_: base.yaml\n" + MINIMAL)
    assert "python/object/apply" in error(tmp_path / "run.yaml")
    assert not marker.exists()


@pytest.mark.parametrize("value, key, shown", [
    ("3", "_base_", "3"), ("null", "_base_", "null"), ("''", "_base_", "''"),
    ("{a: b.yaml}", "_base_", "{'a': 'b.yaml'}"), ("[ok.yaml, 7]", "_base_[1]", "7"),
    ("[[ok.yaml]]", "_base_[0]", "['ok.yaml']"),
])
def test_a_bad_base_value_names_the_file_and_key(tmp_path, value, key, shown):
    files(tmp_path, ok="", run=f"_base_: {value}\n" + MINIMAL)
    assert error(tmp_path / "run.yaml") == (
        f"{tmp_path}/run.yaml: {key}: got {shown}, expected a path (relative to this file) "
        f"or a list of paths")


@pytest.mark.parametrize("value, shown", [("'true'", "'true'"), ("1", "1"), ("null", "null"),
                                          ("[true]", "[True]")])
def test_a_bad_delete_value_names_the_file_and_dotted_key(tmp_path, value, shown):
    files(tmp_path, base=MINIMAL,
          run=f"_base_: base.yaml\ndata:\n  train: {{_delete_: {value}, type: digits}}\n")
    assert error(tmp_path / "run.yaml") == (
        f"{tmp_path}/run.yaml: data.train._delete_: got {shown}, expected true or false")


def test_a_bad_delete_value_in_a_base_names_that_base(tmp_path):
    files(tmp_path, base="_base_: root.yaml\nmodel: {_delete_: yes please}\n", root=MINIMAL,
          run="_base_: base.yaml\n")
    assert error(tmp_path / "run.yaml") == (
        f"{tmp_path}/base.yaml: model._delete_: got 'yes please', expected true or false")


def test_delete_at_the_top_level_and_base_below_it_are_refused(tmp_path):
    files(tmp_path, top="_delete_: true\n" + MINIMAL,
          nested="model: {type: digits_mlp, _base_: other.yaml}\n" + DATA)
    assert error(tmp_path / "top.yaml").startswith(f"{tmp_path}/top.yaml: _delete_ at the top "
                                                   f"level: it goes inside a section")
    assert error(tmp_path / "nested.yaml") == (
        f"{tmp_path}/nested.yaml: model._base_: _base_ is read only at the top level of a file")


@pytest.mark.parametrize("override", ["_base_=other.yaml", "model._delete_=true"])
def test_markers_on_the_command_line_are_refused(tmp_path, override):
    files(tmp_path, run=MINIMAL)
    marker = override.split("=")[0].rpartition(".")[2]
    assert error(tmp_path / "run.yaml", [override]) == (
        f"override {override!r}: {marker} works only inside a config file")


# ---------------------------------------------------------------- the shipped configs

SHIPPED = sorted((REPO / "configs").glob("*.yaml"))
BASES = sorted((REPO / "configs" / "_base_").rglob("*.yaml"))


def test_the_shipped_configs_write_no_section_twice_and_use_every_base():
    """Each top-level section's text is written once across configs/ and configs/_base_; the
    configs inherit the rest. None sets ``name`` (the file's stem), so a config built on one
    is named after its own file. (That they still resolve to what they did before they moved
    onto bases was checked when they moved; tests/examples trains each one.)"""
    written: dict[str, Path] = {}
    for path in [*SHIPPED, *BASES]:
        for key, value in yaml.safe_load(path.read_text()).items():
            assert key != "name", path
            if key == "_base_":
                continue
            text = yaml.safe_dump({key: value}, sort_keys=True)
            assert text not in written, f"{key} in {path.name} repeats {written[text].name}"
            written[text] = path
    named = {(path.parent / base).resolve() for path in [*SHIPPED, *BASES]
             for base in _bases(path)}
    assert {path.resolve() for path in BASES} <= named
    for path in SHIPPED:
        assert load_config(path).name == path.stem


def _bases(path: Path) -> list[str]:
    base = yaml.safe_load(path.read_text()).get("_base_", [])
    return base if isinstance(base, list) else [base]
