"""Preset files and overrides as the user wrote them, read into plain dicts: `base:` inheritance,
strict YAML, and a one-line ConfigError naming the file, line and column for what is wrong.

YAML as a config means it: a key given twice is an error, not a silent last-one-wins, and a
number is what it looks like. YAML 1.1 (PyYAML's) reads `0x10` as 16, `010` as 8, `1:30` as 90,
`off` as false and `2024-01-01` as a date; here those stay text, so the schema's type check names
them, while `true` / `false`, decimal integers (`1_000` too) and floats read as before."""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf, ValueNode

from jaxtron.config.errors import ConfigError

PRESETS = Path(__file__).resolve().parents[1] / "configs"  # shipped in the package: `--config NAME`

INT = re.compile(r"^[-+]?(?:0|[1-9][0-9_]*)$")
BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")


class StrictLoader(yaml.SafeLoader):
    """SafeLoader with decimal-only integers, true/false-only booleans and no duplicate keys."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: SafeLoader merges it
                continue
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark,
                    f"'{key}' is given twice; the second would silently win, so keep one",
                    key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers
            if tag.rsplit(":", 1)[1] not in ("int", "bool", "timestamp")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
StrictLoader.add_implicit_resolver("tag:yaml.org,2002:int", INT, list("-+0123456789"))
StrictLoader.add_implicit_resolver("tag:yaml.org,2002:bool", BOOL, list("tTfF"))


def load(text: str):
    """The document in `text`, read strictly (a yaml.YAMLError with its line and column)."""
    return yaml.load(text, Loader=StrictLoader)  # a SafeLoader subclass


def preset_names() -> list[str]:
    """The presets shipped with jaxtron, as `--config` takes them by name."""
    return sorted(path.stem for path in PRESETS.glob("*.yaml"))


def find(name: str | Path) -> Path:
    """--config's file: `name` where it is a path to a file, else the shipped preset of that name
    (`llama3_8b`, `llama3_8b.yaml`), from any directory; else `name` as given (read says what is
    wrong with it)."""
    path = Path(name)
    if path.is_file() or len(path.parts) != 1:  # a directory named `tiny` (a run's) is no preset
        return path
    preset = PRESETS / (path.name if path.suffix == ".yaml" else f"{path.name}.yaml")
    return preset if preset.is_file() else path


def read(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    """Read a preset, merging it over the file its `base:` names (relative to it). `seen`: the
    presets whose `base:` led here, as named, first the one given (a cycle names them all)."""
    if path.exists() and not path.is_file():  # a directory, /dev/null
        names = sorted(p.name for p in path.glob("*.yaml")) if path.is_dir() else []
        presets = ", ".join(names[:20]) + (f", and {len(names) - 20} more" if names[20:] else "")
        raise ConfigError(f"--config {path} is {'a directory' if path.is_dir() else 'not a file'}"
                          "; give one preset file" + (f" from it ({presets})" if presets else ""))
    if not path.is_file():
        preset = PRESETS / (path.name if path.suffix == ".yaml" else f"{path.name}.yaml")
        hint = not seen and preset.is_file() and path.parent.name == PRESETS.name
        shipped = ", ".join(preset_names())
        raise ConfigError(f"config file not found: {path}"  # `--config configs/tiny` elsewhere
                          + (f" (did you mean --config {preset.stem}?)" if hint else
                             f"; a preset's name is one of {shipped}" if not seen else ""))
    if (resolved := path.resolve()) in (looped := [p.resolve() for p in seen]):
        cycle = " -> ".join(_shown(p) for p in (*seen[looped.index(resolved):], path))
        raise ConfigError(f"config files extend each other in a cycle: {cycle} (each names the "
                          "next in base:); remove base: from one of them")
    try:
        tree = load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}); save the preset as UTF-8") \
            from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{where}: not valid YAML ({problem})") from None
    if tree is None:
        raise ConfigError(f"{path} is empty (or only comments): a preset maps sections to keys "
                          "and values, e.g. `train:` then `  steps: 100`; see "
                          f"{_shown(PRESETS / 'tiny.yaml')}")
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    base = tree.pop("base", None)
    if base is None:
        return tree
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base: {base} should be one file name, e.g. base: gpu_base.yaml")
    if not (path.parent / base).is_file():
        raise ConfigError(f"{path}: base: {base} names no file ({path.parent / base}); a base "
                          "path is relative to the preset that names it")
    return _merged(read(path.parent / base, seen + (path,)), tree)


def _merged(base: dict, preset: dict) -> dict:
    """`preset` over `base`: a section key by key, anything else (a value, a list, a section
    given as something else, which the schema check then names) replaced whole."""
    out = dict(base)
    for key, value in preset.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if both else value
    return out


def _shown(path: Path) -> str:
    """`path` relative to the working directory when it is under it, else absolute."""
    relative = os.path.relpath(path)
    return str(path) if relative.startswith("..") else relative


def parse_override(item: str) -> tuple[str, Any]:
    key, sep, raw = item.partition("=")
    if not sep or not all(part.strip() for part in key.split(".")):
        preset = f"; a preset is loaded with --config {item}" if item.endswith(".yaml") else ""
        raise ConfigError(f"'{item}': an override is section.key=value, e.g. train.steps=100"
                          + preset)
    try:
        value = load(raw) if raw and raw.strip() != "~" else raw  # `~`: home, not YAML's null
    except yaml.YAMLError:
        value = raw
    node: Any = value
    for part in reversed(key.strip().split(".")):
        node = {part: node}
    return key.strip(), node


def auto_microbatches(layer: Any) -> Any:
    """`train.microbatches: auto` as the schema's integer 0 (jaxtron/plan/autofit.py chooses it)."""
    train = layer.get("train") if isinstance(layer, dict) else None
    if isinstance(train, dict) and str(train.get("microbatches")).lower() == "auto":
        return {**layer, "train": {**train, "microbatches": 0}}
    return layer


def bad_value(e: Exception, schema: type, kinds: dict, layer: Any = None) -> str:
    """What to type instead of a value OmegaConf refused: the type its key takes in `schema`
    (the root dataclass), in words (`kinds`: a type's words)."""
    key, value = getattr(e, "full_key", "") or "?", getattr(e, "value", None)
    if "." not in key and layer is not None:  # an item of a list (data.mixture) names only its key
        key = next(_paths_to(layer, key, value), key)
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value)
    elif isinstance(value, ValueNode):  # null for a list: the node that holds None
        value = value._value()
    kind: Any = schema
    for part in re.findall(r"\w+|\[\d+\]", key):  # data.mixture[0].weight -> its float
        if typing.get_origin(kind) is list:
            kind = typing.get_args(kind)[0]
        if not part.startswith("["):
            kind = typing.get_type_hints(kind).get(part) if dataclasses.is_dataclass(kind) else None
    shown = f"[{','.join(map(str, value))}]" if isinstance(value, (list, tuple)) else value
    if key == "run.profile_steps" and isinstance(value, int):
        return f"{key} is [first, last]: write {key}=[{value},{value}] to trace step {value}"
    if typing.get_origin(kind) is list:
        if value is None:
            return (f"{key} is a list: write {key}=[] for none, or {key}=[A,B] "
                    "(items separated by commas)")
        return f"{key} is a list: write {key}=[{shown}] (items separated by commas)"
    if kind in kinds:
        return f"{key} must be {kinds[kind]}, got {shown if shown != '' else 'nothing'}"
    return f"bad value for '{key}': {str(e).splitlines()[0]}"


def _paths_to(node: Any, key: str, value: Any, path: str = ""):
    """The dotted paths (list items as [i]) under which `node` holds `key` set to `value`."""
    if not isinstance(node, (dict, list)):
        return
    for name, child in enumerate(node) if isinstance(node, list) else node.items():
        here = f"{path}[{name}]" if isinstance(node, list) else f"{path}.{name}".lstrip(".")
        if name == key and child == value:
            yield here
        yield from _paths_to(child, key, value, here)
