"""MMEngine's configs (``mmengine.config``): ``Config``, ``ConfigDict`` and ``DictAction``.

``Config.fromfile`` reads MMEngine's config files as MMEngine does: a Python file whose
module-level names are the config (``.py``), or YAML (``.yaml``, ``.yml``) or JSON (``.json``).

A file builds on others with ``_base_ = './base.py'`` (or a list of them; each path relative
to the file that names it, of any of the formats). The bases are read first, none may give a
key another base of the same file gives, and the file's own keys are merged over theirs: a
dict merges key by key, anything else replaces, and a dict with ``_delete_=True`` replaces the
base's value instead of merging into it. ``{{_base_.a.b}}`` (unquoted) stands for the bases'
value at ``a.b``; in a Python file ``_base_`` is also the merged bases as a ``ConfigDict``.
``{{fileDirname}}``, ``{{fileBasename}}``, ``{{fileBasenameNoExtension}}`` and
``{{fileExtname}}`` stand for parts of the file's own path, and ``{{$NAME:default}}`` for an
environment variable. In a Python file, names starting with ``__``, modules and functions are
not config keys, and the file's directory is on ``sys.path`` while it runs (and while
``custom_imports``, a dict ``imports=[...]`` of modules to import after loading, are
imported).

Not supported, refused with a ValueError naming the file: MMEngine's lazy-import configs
(``with read_base():`` and ``lazy_import=True``).
"""

from __future__ import annotations

import argparse
import ast
import copy
import importlib
import json
import math
import os
import re
import sys
import tempfile
import types
import uuid
import warnings
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from trainrun.messages import closest

BASE = "_base_"
DELETE = "_delete_"
FORMATS = {".py": "python", ".yaml": "yaml", ".yml": "yaml", ".json": "json"}
# names Config keeps for itself: no config may have them as keys
RESERVED = ("filename", "text", "pretty_text")

_BASE_REF = re.compile(r"\{\{\s*" + BASE + r"\.([\w.]+)\s*\}\}")
_ENV_REF = re.compile(r"\{\{['\"]?\s*\$(\w+)\s*:\s*(\S*?)\s*['\"]?\}\}")


def _convert(value: Any) -> Any:
    """``value`` with every plain dict in it (in lists and tuples too) a ConfigDict."""
    if type(value) is dict:
        return ConfigDict(value)
    if isinstance(value, list):
        return [_convert(v) for v in value]
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(_convert(v) for v in value)
    return value


def _plain(value: Any) -> Any:
    """``value`` with every ConfigDict in it a plain dict."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(_plain(v) for v in value)
    return value


class ConfigDict(dict):
    """A dict whose keys are also attributes (``cfg.model.type``), as MMEngine's is.

    Every dict put into it, in lists and tuples too, becomes a ConfigDict. Reading an
    attribute that is not a key raises AttributeError naming the key (so ``hasattr`` and
    ``getattr(cfg, name, default)`` work); dict methods (``items``, ``get``, ...) win over
    keys of the same name, which only item access reaches.

    Args:
        *args: what ``dict`` takes: a mapping or key-value pairs.
        **kwargs: keys and values.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.update(*args, **kwargs)

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, _convert(value))

    def update(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """Set keys as ``dict.update`` does, each dict value made a ConfigDict."""
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def setdefault(self, key: Any, default: Any = None) -> Any:
        """``dict.setdefault``, a dict default made a ConfigDict."""
        if key not in self:
            self[key] = default
        return self[key]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy, pickle and the like probe for these
            raise AttributeError(name)
        try:
            return self[name]
        except KeyError:
            hint = closest(name, self, cutoff=0.7)
            raise AttributeError(f"config has no key {name!r}"
                                 + (f"; did you mean {hint!r}?" if hint else "")
                                 + f" Its keys: {', '.join(map(str, self)) or 'none'}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value

    def __delattr__(self, name: str) -> None:
        try:
            del self[name]
        except KeyError:
            raise AttributeError(f"config has no key {name!r}") from None

    def copy(self) -> ConfigDict:
        """A shallow copy, a ConfigDict."""
        return ConfigDict(self)

    __copy__ = copy

    def __deepcopy__(self, memo: dict[int, Any]) -> ConfigDict:
        new = ConfigDict()
        memo[id(self)] = new
        for key, value in self.items():
            dict.__setitem__(new, copy.deepcopy(key, memo), copy.deepcopy(value, memo))
        return new

    def __reduce__(self) -> tuple:
        return ConfigDict, (self.to_dict(),)

    def to_dict(self) -> dict[Any, Any]:
        """A plain dict of plain dicts (in lists and tuples too)."""
        return _plain(self)

    def __repr__(self) -> str:
        return f"ConfigDict({dict.__repr__(self)})"


class Config(MutableMapping[str, Any]):
    """A whole config: a ``ConfigDict`` with the file it came from.

    Keys read as attributes and items (``cfg.train_cfg.max_epochs``, ``cfg['model']``), and
    the mapping methods (``get``, ``in``, ``keys``, ``items``, ``update``, ``pop``, ...) work
    on the config's top level.

    Args:
        cfg_dict: the config's keys and values; None: empty.
        cfg_text: the text it was read from (``text``), if any.
        filename: the file it was read from (``filename``), if any.

    Raises:
        TypeError: when ``cfg_dict`` is not a mapping.
        KeyError: when it has a key Config keeps for itself (``filename``, ``text``,
            ``pretty_text``).
    """

    def __init__(self, cfg_dict: Mapping[str, Any] | None = None, cfg_text: str | None = None,
                 filename: str | os.PathLike[str] | None = None) -> None:
        if cfg_dict is None:
            cfg_dict = {}
        elif isinstance(cfg_dict, Config):
            cfg_dict = cfg_dict.to_dict()
        elif not isinstance(cfg_dict, Mapping):
            raise TypeError(f"Config takes a dict; got {type(cfg_dict).__name__}")
        for key in RESERVED:
            if key in cfg_dict:
                raise KeyError(f"{key!r} is kept by Config for itself; a config cannot have it "
                               f"as a key")
        object.__setattr__(self, "_cfg_dict", ConfigDict(cfg_dict))
        object.__setattr__(self, "_filename", None if filename is None else str(filename))
        object.__setattr__(self, "_text", cfg_text or "")

    # ------------------------------------------------------------------ reading files

    @staticmethod
    def fromfile(filename: str | os.PathLike[str], use_predefined_variables: bool = True,
                 import_custom_modules: bool = True, use_environment_variables: bool = True,
                 lazy_import: bool | None = None) -> Config:
        """Read a config file (``.py``, ``.yaml``, ``.yml`` or ``.json``) and its bases.

        Args:
            filename: the file.
            use_predefined_variables: replace ``{{fileDirname}}`` and the like.
            import_custom_modules: import the modules ``custom_imports`` names.
            use_environment_variables: replace ``{{$NAME:default}}``.
            lazy_import: MMEngine's lazy-import configs; only None or False (not supported).

        Returns:
            The config, its ``filename`` the path given.

        Raises:
            FileNotFoundError: the file or one of its bases does not exist.
            ValueError: an unknown suffix, a bad ``_base_``, a file that is no mapping, a
                cycle of bases, or what is not supported (lazy-import configs); the message
                names the file.
            KeyError: two bases give the same key, a ``{{_base_.key}}`` the bases lack, or an
                environment variable that is not set and has no default.
            TypeError: a dict in a file over a base's value that is no dict (without
                ``_delete_``); the message names the file and the key.
            ImportError: a module ``custom_imports`` names cannot be imported.
        """
        if lazy_import:
            raise ValueError(f"{filename}: lazy_import=True (MMEngine's lazy-import configs) "
                             f"is not supported; write the config with _base_ instead")
        path = Path(filename)
        options = {"predefined": use_predefined_variables, "env": use_environment_variables}
        cfg_dict, texts = _load(path, [], options)
        if import_custom_modules and cfg_dict.get("custom_imports"):
            with _on_sys_path(path.parent):
                _import_custom(cfg_dict["custom_imports"], path)
        return Config(cfg_dict, cfg_text="\n".join(texts), filename=str(filename))

    @staticmethod
    def fromstring(cfg_str: str, file_format: str) -> Config:
        """Read a config from text in one of the file formats.

        Args:
            cfg_str: the config's text.
            file_format: ``'.py'``, ``'.yaml'``, ``'.yml'`` or ``'.json'``.

        Returns:
            The config, without a ``filename``.

        Raises:
            ValueError: an unknown format; else as ``fromfile``.
        """
        if file_format not in FORMATS:
            raise ValueError(f"file_format must be one of {', '.join(FORMATS)}; got "
                             f"{file_format!r}")
        with tempfile.TemporaryDirectory() as directory:
            path = Path(directory) / f"config{file_format}"
            path.write_text(cfg_str, encoding="utf-8")
            cfg = Config.fromfile(path)
        return Config(cfg._cfg_dict, cfg_text=cfg_str)

    # ------------------------------------------------------------------ properties

    @property
    def filename(self) -> str | None:
        """The file the config was read from, as given; None for one made in code."""
        return self._filename

    @property
    def text(self) -> str:
        """The text of the file and its bases, each after its name."""
        return self._text

    @property
    def pretty_text(self) -> str:
        """The config as the text of a Python config file that reads back the same.

        Classes and functions are written as their import paths (strings, which the
        registries look up).

        Raises:
            ValueError: a top-level key that is not a Python name.
        """
        lines = []
        for key, value in self._cfg_dict.items():
            if not (isinstance(key, str) and key.isidentifier()):
                raise ValueError(f"config key {key!r} is not a Python name; dump the config "
                                 f"as YAML or JSON instead")
            lines.append(f"{key} = {_python(value, 0)}")
        return "\n".join(lines) + "\n"

    # ------------------------------------------------------------------ the mapping

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_cfg_dict":  # not yet set while unpickling
            raise AttributeError(name)
        return getattr(self._cfg_dict, name)

    def __setattr__(self, name: str, value: Any) -> None:
        self._cfg_dict[name] = value

    def __delattr__(self, name: str) -> None:
        delattr(self._cfg_dict, name)

    def __getitem__(self, key: str) -> Any:
        return self._cfg_dict[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._cfg_dict[key] = value

    def __delitem__(self, key: str) -> None:
        del self._cfg_dict[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._cfg_dict)

    def __len__(self) -> int:
        return len(self._cfg_dict)

    def __contains__(self, key: object) -> bool:
        return key in self._cfg_dict

    def setdefault(self, key: str, default: Any = None) -> Any:
        """``dict.setdefault`` on the top level, a dict default made a ConfigDict."""
        return self._cfg_dict.setdefault(key, default)

    def __repr__(self) -> str:
        return f"Config (path: {self._filename}): {dict.__repr__(self._cfg_dict)}"

    def __getstate__(self) -> tuple:
        return self._cfg_dict, self._filename, self._text

    def __setstate__(self, state: tuple) -> None:
        for name, value in zip(("_cfg_dict", "_filename", "_text"), state, strict=True):
            object.__setattr__(self, name, value)

    def copy(self) -> Config:
        """A shallow copy: the top level is new, the values are shared."""
        return Config(self._cfg_dict.copy(), self._text, self._filename)

    __copy__ = copy

    def __deepcopy__(self, memo: dict[int, Any]) -> Config:
        new = Config.__new__(Config)
        memo[id(self)] = new
        new.__setstate__((copy.deepcopy(self._cfg_dict, memo), self._filename, self._text))
        return new

    def to_dict(self) -> dict[str, Any]:
        """The config as plain dicts (in lists and tuples too)."""
        return self._cfg_dict.to_dict()

    # ------------------------------------------------------------------ changing and writing

    def merge_from_dict(self, options: Mapping[str, Any], allow_list_keys: bool = True) -> None:
        """Merge dotted keys into the config, as MMEngine's ``--cfg-options`` do.

        ``{'model.backbone.depth': 50}`` sets one value; a dict value merges into what is
        there (``_delete_=True`` in it replaces instead); with ``allow_list_keys`` a number
        addresses a list's item (``{'pipeline.0.type': 'Resize'}``).

        Args:
            options: dotted keys and their values.
            allow_list_keys: let numbers index lists.

        Raises:
            KeyError: a list index past the list's end; the message names the key.
            TypeError: a key below a value that is neither a dict nor (with
                ``allow_list_keys``) a list; the message names the key.
        """
        nested: dict[str, Any] = {}
        for full_key, value in options.items():
            *parents, last = str(full_key).split(".")
            level = nested
            for part in parents:
                level = level.setdefault(part, {})
            level[last] = value
        merged = _merge(nested, self._cfg_dict, "merge_from_dict", "", allow_list_keys)
        object.__setattr__(self, "_cfg_dict", ConfigDict(merged))

    def dump(self, file: str | os.PathLike[str] | None = None) -> str | None:
        """Write the config to ``file`` in the format its suffix names, or return it as text.

        Args:
            file: a ``.py``, ``.yaml``, ``.yml`` or ``.json`` file to write; None: return the
                text instead, in the format of ``filename`` (Python when there is none).

        Returns:
            The text when ``file`` is None, else None.

        Raises:
            ValueError: an unknown suffix, or a value the format cannot hold (the message
                names the key).
        """
        if file is None:
            suffix = Path(self._filename).suffix if self._filename else ".py"
            return self._as_text(FORMATS.get(suffix, "python"), "the config")
        path = Path(file)
        form = FORMATS.get(path.suffix)
        if form is None:
            suffix = path.suffix or "a file with no suffix"
            raise ValueError(f"{path}: cannot dump a config as {suffix}; use one of "
                             f"{', '.join(FORMATS)}")
        path.write_text(self._as_text(form, str(path)), encoding="utf-8")
        return None

    def _as_text(self, form: str, where: str) -> str:
        if form == "python":
            return self.pretty_text
        plain = _serialisable(self.to_dict(), where, "")
        if form == "json":
            return json.dumps(plain, indent=4) + "\n"
        return yaml.safe_dump(plain, sort_keys=False, default_flow_style=False)


class DictAction(argparse.Action):
    """An argparse action that reads ``KEY=VALUE`` arguments into a dict, as MMEngine's.

    A value is a Python-like literal: ``1`` an int, ``0.5`` a float, ``true``/``false`` (any
    case) a bool, ``None`` None, ``a,b`` and ``[a,b]`` a list, ``(a,b)`` a tuple (nested
    brackets work), anything else a string (quotes around it are dropped). Give it
    ``nargs='+'``; the dict suits ``Config.merge_from_dict``.
    """

    @staticmethod
    def _scalar(text: str) -> Any:
        for kind in (int, float):
            try:
                return kind(text)
            except ValueError:
                pass
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        return None if text == "None" else text

    @staticmethod
    def _split(text: str) -> list[str]:
        """``text`` cut at the commas outside brackets."""
        parts, depth, start = [], 0, 0
        for index, char in enumerate(text):
            depth += (char in "([") - (char in ")]")
            if char == "," and depth == 0:
                parts.append(text[start:index])
                start = index + 1
        parts.append(text[start:])
        return parts

    @staticmethod
    def _parse(text: str) -> Any:
        text = text.strip().strip("'\"").replace(" ", "")
        bracket = text[:1] in "([" and text[-1:] == {"(": ")", "[": "]"}.get(text[:1])
        if bracket:
            inner = text[1:-1]
            items = [DictAction._parse(p) for p in DictAction._split(inner)] if inner else []
            return tuple(items) if text[0] == "(" else items
        parts = DictAction._split(text)
        if len(parts) == 1:
            return DictAction._scalar(text)
        return [DictAction._parse(p) for p in parts]

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        options = dict(getattr(namespace, self.dest, None) or {})
        for item in values if isinstance(values, list) else [values]:
            key, sep, value = item.partition("=")
            if not sep or not key:
                parser.error(f"{option_string or self.dest}: {item!r} is not KEY=VALUE")
            options[key] = self._parse(value)
        setattr(namespace, self.dest, options)


# ---------------------------------------------------------------------- loading


def _load(path: Path, chain: list[Path], options: Mapping[str, bool]
          ) -> tuple[dict[str, Any], list[str]]:
    """One file merged over its bases: (the config, the texts of the bases and the file)."""
    form = FORMATS.get(path.suffix)
    if form is None:
        raise ValueError(f"{path}: a config file must end in {', '.join(FORMATS)}")
    if not path.is_file():
        named_by = f" (named in {BASE} of {chain[-1]})" if chain else ""
        raise FileNotFoundError(f"config file not found: {path}{named_by}")
    if path.resolve() in chain:
        names = " -> ".join(str(p) for p in [*chain, path.resolve()])
        raise ValueError(f"{path}: {BASE} files form a cycle: {names}")
    source = path.read_text(encoding="utf-8")
    text = source
    if options["predefined"]:
        text = _predefined(text, path)
    if options["env"]:
        text = _environment(text, path)
    text, references = _mark_base_references(text)
    if form == "python":
        tree, bases = _python_bases(text, path)
    else:
        content = _read_data(text, path, form)
        bases = _base_list(content.pop(BASE, None), path)
    base_cfg: dict[str, Any] = {}
    texts: list[str] = []
    given_by: dict[str, Path] = {}
    for base in bases:
        base_path = path.parent / os.path.expanduser(base)
        content_of_base, base_texts = _load(base_path, [*chain, path.resolve()], options)
        texts += base_texts
        for key in content_of_base:
            if key in given_by:
                raise KeyError(f"{path}: key {key!r} is given by two of its bases, "
                               f"{given_by[key]} and {base_path}; bases may not share keys")
            given_by[key] = base_path
        base_cfg.update(content_of_base)
    if form == "python":
        content = _run_python(tree, path, base_cfg)
    content = _substitute(content, references, base_cfg, path)
    texts.append(f"{path}\n{source}")
    return _merge(content, base_cfg, str(path), "", False), texts


def _predefined(text: str, path: Path) -> str:
    """``text`` with ``{{fileDirname}}`` and the like replaced by parts of ``path``."""
    values = {"fileDirname": str(path.parent), "fileBasename": path.name,
              "fileBasenameNoExtension": path.stem, "fileExtname": path.suffix}
    for name, value in values.items():
        shown = value.replace("\\", "/")
        text = re.sub(r"\{\{\s*" + name + r"\s*\}\}", lambda _, shown=shown: shown, text)
    return text


def _environment(text: str, path: Path) -> str:
    """``text`` with ``{{$NAME:default}}`` replaced by the variable's value or the default."""

    def value(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        found = os.environ.get(name, default)
        if not found:
            raise KeyError(f"{path}: environment variable {name!r} is not set and "
                           f"{{{{${name}:...}}}} gives no default")
        return found

    return _ENV_REF.sub(value, text)


def _mark_base_references(text: str) -> tuple[str, dict[str, str]]:
    """``text`` with each ``{{_base_.a.b}}`` a unique string literal; and what each stands
    for (``a.b``)."""
    references: dict[str, str] = {}

    def mark(match: re.Match[str]) -> str:
        marker = f"_trainrun_base_{uuid.uuid4().hex[:12]}_"
        references[marker] = match.group(1)
        return f'"{marker}"'

    return _BASE_REF.sub(mark, text), references


def _substitute(value: Any, references: Mapping[str, str], base_cfg: Mapping[str, Any],
                path: Path) -> Any:
    """``value`` with each marked ``{{_base_.a.b}}`` replaced by a copy of the bases' value."""
    if not references:
        return value
    if isinstance(value, str) and value in references:
        found: Any = base_cfg
        for part in references[value].split("."):
            if not isinstance(found, Mapping) or part not in found:
                raise KeyError(f"{path}: {{{{{BASE}.{references[value]}}}}}: its bases have no "
                               f"key {references[value]!r}")
            found = found[part]
        return copy.deepcopy(found)
    if isinstance(value, dict):
        return {k: _substitute(v, references, base_cfg, path) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(v, references, base_cfg, path) for v in value]
    if type(value) is tuple:
        return tuple(_substitute(v, references, base_cfg, path) for v in value)
    return value


def _base_list(value: Any, path: Path) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    raise ValueError(f"{path}: {BASE} must be a path or a list of paths; got {value!r}")


def _read_data(text: str, path: Path, form: str) -> dict[str, Any]:
    """A YAML or JSON file's mapping."""
    try:
        content = json.loads(text) if form == "json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as error:
        raise ValueError(f"{path}: not valid {form.upper()}: {error}") from None
    if content is None:
        return {}
    if not isinstance(content, dict):
        raise ValueError(f"{path}: a config file must hold a mapping; got "
                         f"{type(content).__name__}")
    return content


def _is_read_base(node: ast.AST) -> bool:
    if not isinstance(node, ast.With):
        return False
    for item in node.items:
        call = item.context_expr
        func = call.func if isinstance(call, ast.Call) else None
        if getattr(func, "id", None) == "read_base" or getattr(func, "attr", None) == "read_base":
            return True
    return False


def _python_bases(text: str, path: Path) -> tuple[ast.Module, list[str]]:
    """A Python config's syntax tree without its ``_base_`` assignment, and its bases."""
    tree = ast.parse(text, filename=str(path))
    bases: list[str] = []
    body = []
    for node in tree.body:
        if _is_read_base(node):
            raise ValueError(f"{path}: 'with read_base():' (MMEngine's lazy-import config) is "
                             f"not supported; name the base files with _base_ = [...] instead")
        targets = node.targets if isinstance(node, ast.Assign) else []
        if any(isinstance(t, ast.Name) and t.id == BASE for t in targets):
            try:
                value = ast.literal_eval(node.value)  # type: ignore[attr-defined]
            except ValueError:
                raise ValueError(f"{path}, line {node.lineno}: {BASE} must be a literal path "
                                 f"or list of paths") from None
            bases = _base_list(value, path)
            continue
        body.append(node)
    tree.body = body
    return tree, bases


@contextmanager
def _on_sys_path(directory: Path) -> Iterator[None]:
    """``directory`` first on ``sys.path`` for the duration."""
    entry = str(directory.resolve())
    sys.path.insert(0, entry)
    try:
        yield
    finally:
        if entry in sys.path:
            sys.path.remove(entry)


def _run_python(tree: ast.Module, path: Path, base_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The config keys a Python config file's code defines."""
    namespace: dict[str, Any] = {BASE: ConfigDict(copy.deepcopy(dict(base_cfg))),
                                 "__file__": str(path), "__name__": "__trainrun_config__"}
    code = compile(tree, str(path), "exec")
    with _on_sys_path(path.parent):
        exec(code, namespace)  # noqa: S102 - running the config is what reading it means
    return {k: v for k, v in namespace.items()
            if not k.startswith("__") and k != BASE
            and not isinstance(v, (types.ModuleType, types.FunctionType))}


def _import_custom(custom: Any, path: Path) -> None:
    """Import the modules of ``custom_imports=dict(imports=[...], allow_failed_imports=...)``."""
    if not isinstance(custom, Mapping) or "imports" not in custom:
        raise ValueError(f"{path}: custom_imports must be dict(imports=[module, ...]); got "
                         f"{custom!r}")
    imports = custom["imports"]
    names = [imports] if isinstance(imports, str) else imports
    if not (isinstance(names, (list, tuple)) and all(isinstance(n, str) for n in names)):
        raise ValueError(f"{path}: custom_imports.imports must be a module name or a list of "
                         f"them; got {imports!r}")
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as error:
            if not custom.get("allow_failed_imports", False):
                raise ImportError(f"{path}: custom_imports: cannot import {name!r}: "
                                  f"{error}") from error
            warnings.warn(f"{path}: custom_imports: {name!r} could not be imported ({error}); "
                          f"going on without it", UserWarning, stacklevel=3)


def _merge(child: Mapping[Any, Any], base: Any, where: str, prefix: str,
           allow_list_keys: bool) -> Any:
    """``child`` merged over ``base`` (a dict, or with ``allow_list_keys`` a list whose items
    ``child``'s number keys name): a new value, neither input changed."""
    if isinstance(base, list):
        merged_list = list(base)
        for key, value in child.items():
            if not str(key).isdigit():
                raise TypeError(f"{where}: {prefix}{key}: {prefix.rstrip('.')} is a list; "
                                f"only numbers index it")
            index = int(key)
            if index >= len(merged_list):
                raise KeyError(f"{where}: {prefix}{key}: index {index} is past the end of "
                               f"{prefix.rstrip('.')}, a list of {len(merged_list)}")
            item = merged_list[index]
            if isinstance(value, dict) and isinstance(item, (dict, list)) and \
                    not value.get(DELETE, False):
                merged_list[index] = _merge(value, item, where, f"{prefix}{key}.",
                                            allow_list_keys)
            else:
                merged_list[index] = _without_delete(value)
        return merged_list
    merged = dict(base)
    for key, value in child.items():
        if not isinstance(value, dict):
            merged[key] = value
            continue
        if key in merged and not value.get(DELETE, False):
            allowed = (dict, list) if allow_list_keys else dict
            if not isinstance(merged[key], allowed):
                raise TypeError(f"{where}: {prefix}{key} is a dict here but a "
                                f"{type(merged[key]).__name__} in its base "
                                f"({merged[key]!r}); set {DELETE}=True in it to replace "
                                f"the base's value")
            merged[key] = _merge(value, merged[key], where, f"{prefix}{key}.", allow_list_keys)
        else:
            merged[key] = _without_delete(value)
    return merged


def _without_delete(value: Any) -> Any:
    """``value`` without ``_delete_`` keys in its dicts."""
    if isinstance(value, dict):
        return {k: _without_delete(v) for k, v in value.items() if k != DELETE}
    if isinstance(value, list):
        return [_without_delete(v) for v in value]
    return value


# ---------------------------------------------------------------------- writing


def _import_path(obj: Any) -> str | None:
    """``module.QualName`` of a class or function, else None."""
    if isinstance(obj, type) or isinstance(obj, (types.FunctionType, types.BuiltinFunctionType)):
        return f"{obj.__module__}.{obj.__qualname__}"
    return None


def _serialisable(value: Any, where: str, key: str) -> Any:
    """``value`` as YAML and JSON can hold it: tuples as lists, classes and functions as
    their import paths; ValueError naming the key for anything else that is no plain value."""
    if isinstance(value, dict):
        return {k: _serialisable(v, where, f"{key}.{k}" if key else str(k))
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_serialisable(v, where, f"{key}[{i}]") for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    path = _import_path(value)
    if path is not None:
        return path
    raise ValueError(f"{where}: cannot write {key} ({type(value).__name__}: {value!r}) as "
                     f"YAML or JSON; dump it as a .py file")


def _python(value: Any, indent: int) -> str:
    """``value`` as Python source that evaluates to it, nested ``indent`` spaces deep."""
    inner = " " * (indent + 4)
    if isinstance(value, dict):
        if not value:
            return "dict()"
        if all(isinstance(k, str) and k.isidentifier() for k in value):
            items = [f"{inner}{k}={_python(v, indent + 4)}," for k, v in value.items()]
            return "dict(\n" + "\n".join(items) + f"\n{' ' * indent})"
        items = [f"{inner}{k!r}: {_python(v, indent + 4)}," for k, v in value.items()]
        return "{\n" + "\n".join(items) + f"\n{' ' * indent}}}"
    if isinstance(value, (list, tuple)):
        open_, close = ("[", "]") if isinstance(value, list) else ("(", ")")
        parts = [_python(v, indent + 4) for v in value]
        if isinstance(value, tuple) and len(parts) == 1:
            return f"({parts[0]},)"
        one_line = open_ + ", ".join(parts) + close
        if "\n" not in one_line and len(one_line) + indent <= 88:
            return one_line
        return open_ + "\n" + "\n".join(f"{inner}{p}," for p in parts) + f"\n{' ' * indent}{close}"
    if isinstance(value, float) and not math.isfinite(value):
        return f"float({str(value)!r})"
    path = _import_path(value)
    if path is not None:
        return repr(path)
    return repr(value)


__all__ = ["Config", "ConfigDict", "DictAction"]
