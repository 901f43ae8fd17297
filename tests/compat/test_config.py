"""MMEngine-style configs: Python, YAML and JSON files with their bases, access, merging
dotted keys, dumping and reading back, and the errors, each naming the file and the key."""

from __future__ import annotations

import argparse
import copy
import pickle
import sys
from pathlib import Path

import pytest
import torch

from trainrun.compat.mmengine.config import Config, ConfigDict, DictAction


def write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_python_config_with_a_chain_of_bases(tmp_path):
    write(tmp_path, "bases/runtime.py", "import os\n"
          "default_hooks = dict(logger=dict(interval=10))\nseed = 0\n")
    write(tmp_path, "bases/model.py", "_base_ = './runtime.py'\n"
          "model = dict(type='Net', depth=50, head=dict(num_classes=10, loss='ce'))\n"
          "train_cfg = dict(by_epoch=True, max_epochs=12)\n")
    path = write(tmp_path, "exp.py", "_base_ = './bases/model.py'\n"
                 "model = dict(depth=101, head=dict(_delete_=True, num_classes=5))\n"
                 "train_cfg = dict(max_epochs=_base_.train_cfg.max_epochs * 2)\n"
                 "def helper():\n    return 1\n"
                 "__hidden = 1\n")
    cfg = Config.fromfile(path)
    assert cfg.filename == str(path)
    assert cfg.to_dict() == {
        "default_hooks": {"logger": {"interval": 10}}, "seed": 0,
        "model": {"type": "Net", "depth": 101, "head": {"num_classes": 5}},
        "train_cfg": {"by_epoch": True, "max_epochs": 24}}
    assert cfg.train_cfg.max_epochs == 24 and cfg["model"]["head"].num_classes == 5
    assert cfg.get("seed") == 0 and cfg.get("nothing", 7) == 7 and "model" in cfg
    assert isinstance(cfg.model, ConfigDict)
    assert str(path) in cfg.text and "runtime.py" in cfg.text


def test_a_list_of_bases_yaml_and_base_references(tmp_path):
    write(tmp_path, "data.yaml", "train_dataloader:\n  batch_size: 8\n  dataset: {type: Toy}\n")
    write(tmp_path, "optim.json", '{"optim_wrapper": {"optimizer": {"type": "SGD", "lr": 0.1}}}')
    path = write(tmp_path, "exp.yaml", "_base_: [data.yaml, optim.json]\n"
                 "train_dataloader: {batch_size: 16}\n"
                 "val_dataloader: {{_base_.train_dataloader}}\n"
                 "work_dir: ./work/{{ fileBasenameNoExtension }}\n")
    cfg = Config.fromfile(path)
    assert cfg.train_dataloader.to_dict() == {"batch_size": 16, "dataset": {"type": "Toy"}}
    assert cfg.val_dataloader.to_dict() == {"batch_size": 8, "dataset": {"type": "Toy"}}
    assert cfg.optim_wrapper.optimizer.lr == 0.1 and cfg.work_dir == "./work/exp"


def test_a_python_config_runs_with_its_directory_on_sys_path(tmp_path):
    write(tmp_path, "cfg_helpers_mod.py", "WIDTH = 64\n")
    path = write(tmp_path, "exp.py", "from cfg_helpers_mod import WIDTH\nimport torch\n"
                 "model = dict(width=WIDTH, act=torch.nn.ReLU)\n")
    cfg = Config.fromfile(path)
    assert cfg.model.width == 64 and cfg.model.act is torch.nn.ReLU
    assert "WIDTH" in cfg and "torch" not in cfg  # names are keys, modules are not
    assert str(tmp_path) not in sys.path
    sys.modules.pop("cfg_helpers_mod", None)


def test_custom_imports_are_imported(tmp_path):
    write(tmp_path, "cfg_custom_mod.py", "LOADED = True\n")
    path = write(tmp_path, "exp.py", "custom_imports = dict(imports=['cfg_custom_mod'])\n")
    try:
        Config.fromfile(path)
        assert sys.modules["cfg_custom_mod"].LOADED
    finally:
        sys.modules.pop("cfg_custom_mod", None)
    bad = write(tmp_path, "bad.py", "custom_imports = dict(imports=['no_such_cfg_module'])\n")
    with pytest.raises(ImportError, match=r"bad.py: custom_imports: cannot import "
                                          r"'no_such_cfg_module'"):
        Config.fromfile(bad)
    allowed = write(tmp_path, "allowed.py", "custom_imports = dict(imports=['no_such_cfg_module'],"
                    " allow_failed_imports=True)\n")
    with pytest.warns(UserWarning, match="could not be imported"):
        Config.fromfile(allowed)


@pytest.mark.parametrize("suffix", [".py", ".yaml", ".json"])
def test_dump_and_read_back(tmp_path, suffix):
    cfg = Config(dict(model=dict(type="Net", layers=[1, 2], pair=(3, 4), extra={"a-b": 1}),
                      lr=0.5, flag=True, nothing=None, optimizer=dict(type=torch.optim.SGD),
                      pipeline=[dict(type="Load"), dict(type="Resize", scale=(1, 2))]))
    out = tmp_path / f"dumped{suffix}"
    cfg.dump(out)
    back = Config.fromfile(out)
    expected = cfg.to_dict()
    expected["optimizer"]["type"] = "torch.optim.sgd.SGD"  # written as its import path
    if suffix != ".py":  # YAML and JSON have no tuples
        expected["model"]["pair"] = [3, 4]
        expected["pipeline"][1]["scale"] = [1, 2]
    assert back.to_dict() == expected
    assert back.dump() == out.read_text()


def test_pretty_text_is_python_that_reads_back(tmp_path):
    cfg = Config(dict(a=dict(b=[1, (2,)], c=float("inf")), d="x"))
    assert Config.fromstring(cfg.pretty_text, ".py").to_dict() == cfg.to_dict()
    assert Config().dump() == "\n"
    with pytest.raises(ValueError, match="'a-b' is not a Python name"):
        Config({"a-b": 1}).pretty_text  # noqa: B018


def test_merge_from_dict():
    cfg = Config(dict(model=dict(backbone=dict(type="ResNet", depth=50)),
                      pipeline=[dict(type="Load"), dict(type="Resize")], lr=0.1))
    cfg.merge_from_dict({"model.backbone.depth": 101, "model.neck.type": "FPN",
                         "pipeline.1.type": "Crop", "lr": 0.2})
    assert cfg.to_dict() == {
        "model": {"backbone": {"type": "ResNet", "depth": 101}, "neck": {"type": "FPN"}},
        "pipeline": [{"type": "Load"}, {"type": "Crop"}], "lr": 0.2}
    cfg.merge_from_dict({"model.backbone": dict(_delete_=True, type="ViT")})
    assert cfg.model.backbone.to_dict() == {"type": "ViT"}
    with pytest.raises(KeyError, match="pipeline.5: index 5 is past the end of pipeline"):
        cfg.merge_from_dict({"pipeline.5.type": "X"})
    with pytest.raises(TypeError, match="lr is a dict here but a float"):
        cfg.merge_from_dict({"lr.value": 1})
    with pytest.raises(TypeError, match="pipeline is a dict here but a list"):
        cfg.merge_from_dict({"pipeline.0.type": "X"}, allow_list_keys=False)


def test_config_and_config_dict_access():
    cfg = Config(dict(a=dict(b=1), items_=[dict(c=2)]))
    cfg.x = dict(y=3)
    cfg["z"] = 4
    assert cfg.x.y == 3 and cfg.z == 4 and cfg.items_[0].c == 2
    assert set(cfg) == {"a", "items_", "x", "z"} and len(cfg) == 4
    with pytest.raises(AttributeError, match="config has no key 'bb'"):
        cfg.a.bb  # noqa: B018
    with pytest.raises(AttributeError, match="config has no key 'nothing'"):
        cfg.nothing  # noqa: B018
    assert getattr(cfg.a, "bb", None) is None
    deep = copy.deepcopy(cfg)
    deep.a.b = 9
    assert cfg.a.b == 1
    assert pickle.loads(pickle.dumps(cfg)).to_dict() == cfg.to_dict()
    assert pickle.loads(pickle.dumps(cfg.a)) == {"b": 1}
    assert type(cfg.to_dict()["a"]) is dict
    with pytest.raises(KeyError, match="'filename' is kept by Config"):
        Config(dict(filename="x"))
    with pytest.raises(TypeError, match="Config takes a dict; got list"):
        Config([1])


def test_file_errors_name_the_file_and_the_key(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.py"):
        Config.fromfile(tmp_path / "missing.py")
    with pytest.raises(ValueError, match=r"cfg.txt: a config file must end in \.py"):
        Config.fromfile(write(tmp_path, "cfg.txt", "a = 1"))
    path = write(tmp_path, "nobase.py", "_base_ = './gone.py'\n")
    with pytest.raises(FileNotFoundError, match=r"gone.py \(named in _base_ of .*nobase.py\)"):
        Config.fromfile(path)
    write(tmp_path, "loop_a.yaml", "_base_: loop_b.yaml\n")
    write(tmp_path, "loop_b.yaml", "_base_: loop_a.yaml\n")
    with pytest.raises(ValueError, match="form a cycle: .*loop_a.yaml -> .*loop_b.yaml -> "
                                         ".*loop_a.yaml"):
        Config.fromfile(tmp_path / "loop_a.yaml")
    write(tmp_path, "one.py", "lr = 1\n")
    write(tmp_path, "two.py", "lr = 2\n")
    with pytest.raises(KeyError, match="dup.py: key 'lr' is given by two of its bases"):
        Config.fromfile(write(tmp_path, "dup.py", "_base_ = ['one.py', 'two.py']\n"))
    with pytest.raises(TypeError, match=r"over.py: lr is a dict here but a int in its base"):
        Config.fromfile(write(tmp_path, "over.py", "_base_ = 'one.py'\nlr = dict(a=1)\n"))
    assert Config.fromfile(write(tmp_path, "deleted.py", "_base_ = 'one.py'\n"
                                 "lr = dict(_delete_=True, a=1)\n")).lr == {"a": 1}
    with pytest.raises(KeyError, match=r"ref.py: \{\{_base_.nothing\}\}: its bases have no key"):
        Config.fromfile(write(tmp_path, "ref.py", "_base_ = 'one.py'\nx = {{_base_.nothing}}\n"))
    with pytest.raises(ValueError, match="badbase.yaml: _base_ must be a path or a list"):
        Config.fromfile(write(tmp_path, "badbase.yaml", "_base_: 3\n"))
    with pytest.raises(ValueError, match="list.yaml: a config file must hold a mapping; got list"):
        Config.fromfile(write(tmp_path, "list.yaml", "- 1\n"))
    with pytest.raises(ValueError, match="broken.yaml: not valid YAML"):
        Config.fromfile(write(tmp_path, "broken.yaml", "a: [1\n"))
    with pytest.raises(SyntaxError):
        Config.fromfile(write(tmp_path, "syntax.py", "a = (\n"))


def test_unsupported_configs_are_refused(tmp_path):
    path = write(tmp_path, "new_style.py", "from mmengine.config import read_base\n"
                 "with read_base():\n    from .base import *\n")
    with pytest.raises(ValueError, match=r"new_style.py: 'with read_base\(\):'.* not supported"):
        Config.fromfile(path)
    with pytest.raises(ValueError, match="lazy_import=True .* is not supported"):
        Config.fromfile(write(tmp_path, "plain.py", "a = 1\n"), lazy_import=True)
    with pytest.raises(ValueError, match=r"dumped.toml: cannot dump a config as \.toml"):
        Config(dict(a=1)).dump(tmp_path / "dumped.toml")


def test_environment_variables(tmp_path, monkeypatch):
    path = write(tmp_path, "env.py", "root = '{{$CFG_TEST_ROOT:/data}}/images'\n")
    monkeypatch.delenv("CFG_TEST_ROOT", raising=False)
    assert Config.fromfile(path).root == "/data/images"
    monkeypatch.setenv("CFG_TEST_ROOT", "/mnt")
    assert Config.fromfile(path).root == "/mnt/images"


def test_dict_action_reads_cfg_options():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cfg-options", nargs="+", action=DictAction)
    args = parser.parse_args(["--cfg-options", "a.b=1", "lr=0.5", "flag=False", "none=None",
                              "name=abc", "ids=1,2", "shape=(3,[4,5])", "empty=[]"])
    assert args.cfg_options == {"a.b": 1, "lr": 0.5, "flag": False, "none": None,
                                "name": "abc", "ids": [1, 2], "shape": (3, [4, 5]),
                                "empty": []}
    with pytest.raises(SystemExit):
        parser.parse_args(["--cfg-options", "novalue"])
