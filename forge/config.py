"""Config files: YAML through OmegaConf, dotted CLI overrides, validation into dataclasses.

Every problem becomes one `ConfigError` whose message names the key or file that is
wrong and where it came from, so `forge run` can print one line instead of a traceback.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from omegaconf.nodes import StringNode

T = TypeVar("T")


class ConfigError(ValueError):
    """A bad config: the message is one line naming the key or file."""


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _explain(e: OmegaConfBaseException, source: str) -> ConfigError:
    key = getattr(e, "full_key", None)
    what = _first_line(e)
    kind = type(e).__name__
    if kind == "ConfigKeyError" and key:
        return ConfigError(f"unknown config key '{key}' ({source}): {what}")
    if kind == "MissingMandatoryValue" and key:
        return ConfigError(f"config key '{key}' has no value ({source}); set it in the file or as {key}=...")
    if key:
        return ConfigError(f"config key '{key}' ({source}): {what}")
    return ConfigError(f"{source}: {what}")


def read_yaml(path: str | Path, _seen: tuple[Path, ...] = ()) -> DictConfig:
    """A config file; one with a `base: FILE` key (relative to it) is that file with its own keys on top."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        cfg = OmegaConf.load(path)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: invalid YAML ({getattr(e, 'problem', None) or e})") from None
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"{path}: the top level must be a mapping of keys")
    base = read_key(cfg, "base", str(path), pop=True)
    if base is None:
        return cfg
    if path.resolve() in _seen:
        raise ConfigError(f"{path}: config key 'base' makes a cycle ({' -> '.join(map(str, _seen))})")
    if not (path.parent / str(base)).is_file():  # named with the file whose `base` it is
        raise ConfigError(f"config key 'base' ({path}): config file not found: {path.parent / str(base)}")
    return merge(read_yaml(path.parent / str(base), (*_seen, path.resolve())), cfg, str(path))


def read_key(cfg: DictConfig, key: str, source: str, pop: bool = False) -> Any:
    """Top-level `key` of `cfg` (read from `source`), or None; with `pop`, taken out of it. An
    interpolation that does not resolve is a ConfigError naming the key."""
    try:
        return cfg.pop(key, None) if pop else OmegaConf.select(cfg, key)
    except OmegaConfBaseException as e:
        raise _explain(e, source) from None


Override = str | Mapping[str, Any]  # "key=value" (the value read as YAML), or {dotted key: value} taken as it is


def parse_overrides(overrides: Sequence[Override]) -> list[DictConfig]:
    """The layers of command-line overrides, in order: each run of "key=value" strings, the value
    read as YAML (trainer.lr=1e-4 a float), and each mapping, its values as they are (a run
    directory's name "007" stays that string)."""
    for o in overrides:
        if isinstance(o, str) and ("=" not in o or o.startswith("=")):
            raise ConfigError(f"command-line override {o!r} is not of the form key=value (e.g. trainer.lr=1e-4)")
        if isinstance(o, str):
            _yaml_value(o)
    layers = []
    try:
        for literal, run in itertools.groupby(overrides, lambda o: not isinstance(o, str)):
            if not literal:
                layers.append(OmegaConf.from_dotlist(list(run)))
                continue
            for values in run:
                layer = OmegaConf.create({})
                for key, value in values.items():
                    OmegaConf.update(layer, key, value)
                layers.append(layer)
    except OmegaConfBaseException as e:
        raise _explain(e, "command line") from None
    return layers


def _yaml_value(override: str) -> Any:
    """The value of "key=value" read as YAML; a value that is not YAML is a ConfigError naming the key."""
    key = override.partition("=")[0]
    try:
        return OmegaConf.select(OmegaConf.from_dotlist([override]), key)
    except yaml.YAMLError as e:
        what = getattr(e, "problem", None) or _first_line(e)
        raise ConfigError(f"config key '{key}' (command line): its value is not YAML ({what})") from None


def load_config(
    path: str | Path | None, overrides: Sequence[Override] = (), schema: type[T] | None = None
) -> T | DictConfig:
    """Load `path`, apply `key=value` overrides (or mappings of values, parse_overrides),
    validate against the `schema` dataclass.

    Returns a `schema` instance (interpolations resolved, `validate()` run if the schema
    has one), or a resolved DictConfig when no schema is given.
    """
    layers: list[tuple[str, DictConfig]] = []
    if path is not None:
        layers.append((str(path), read_yaml(path)))
    merged = OmegaConf.structured(schema) if schema is not None else OmegaConf.create({})
    overrides = [_as_text(merged, o) for o in overrides]
    layers += [("command line", layer) for layer in parse_overrides(overrides)]
    for source, layer in layers:
        _refuse_moved(layer, source, getattr(schema, "MOVED", {}), merged)
        merged = merge(merged, layer, source)
    where = " + ".join(s for s, _ in layers) or "defaults"
    try:
        if schema is None:
            OmegaConf.resolve(merged)
            return merged
        obj = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise _explain(e, where) from None
    except (ValueError, TypeError) as e:  # raised by a dataclass __post_init__
        raise ConfigError(f"{where}: {_first_line(e)}") from None
    try:
        _validate(obj)
    except ConfigError:
        raise
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(f"{where}: {_first_line(e)}") from None
    return obj


def merge(cfg: DictConfig, layer: DictConfig, source: str) -> DictConfig:
    """`layer` (read from `source`) on top of `cfg`; a key it cannot take is a ConfigError naming it."""
    try:
        return OmegaConf.merge(cfg, layer)
    except OmegaConfBaseException as e:
        raise _explain(e, source) from None
    except TypeError:  # OmegaConf's plain error for a mapping merged into a list, or a list into one
        key = _mismatch(cfg, layer) or "?"
        given = OmegaConf.select(layer, key, default=None) if key != "?" else None
        want = "a list (e.g. KEY=[...])" if isinstance(given, DictConfig) else "a mapping (e.g. KEY={...})"
        raise ConfigError(f"config key '{key}' ({source}) takes {want.replace('KEY', key)}") from None


def _as_text(schema: DictConfig, override: Override) -> Override:
    """A "key=value" override of a text key whose value YAML reads as something else (a number, a
    boolean, a mapping), or not at all, as its text: run_name=010 names the run 010, not YAML's
    octal 8, and dataset.template={question} is that template, not a mapping."""
    if not isinstance(override, str) or "=" not in override:
        return override
    key, _, text = override.partition("=")
    try:
        parent, _, name = key.rpartition(".")
        section = OmegaConf.select(schema, parent) if parent else schema
        node = section._get_node(name) if isinstance(section, DictConfig) else None
    except OmegaConfBaseException:
        return override  # an unknown or malformed key: parse_overrides and the merge name it
    if not isinstance(node, StringNode):
        return override
    try:
        value = _yaml_value(override)
    except (ConfigError, OmegaConfBaseException):
        return {key: text}  # not YAML (a template "{question} is"): text is what a text key takes
    return override if value is None or isinstance(value, str) else {key: text}


def _mismatch(old: Any, new: Any, path: str = "") -> str | None:
    """The dotted key where `new` puts a mapping on a list of `old`, or a list on a mapping."""
    if isinstance(old, DictConfig) and isinstance(new, DictConfig):
        for key in new:
            found = _mismatch(old._get_node(key) if key in old else None, new._get_node(key), f"{path}.{key}")
            if found:
                return found
        return None
    pair = {type(old), type(new)}
    return path.lstrip(".") if DictConfig in pair and ListConfig in pair else None


def _refuse_moved(layer: DictConfig, source: str, moved: dict[str, tuple[str, str]], schema: DictConfig) -> None:
    """A key of an earlier layout (`moved`: old key -> its key now, why) is a ConfigError that
    says where it lives now. An old key ending in `.*` stands for any number under that section
    that is not one of the section's own keys (e.g. `rewards: {exact: 1.0}`)."""
    for old, (new, why) in moved.items():
        if old.endswith(".*"):
            section, own = OmegaConf.select(layer, old[:-2]), OmegaConf.select(schema, old[:-2])
            names = [
                k
                for k, v in (section.items() if isinstance(section, DictConfig) else [])
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in (own or {})
            ]
            found = [(f"{old[:-2]}.{k}", new.replace("*", str(k))) for k in names]
        else:
            found = [(old, new)] if OmegaConf.select(layer, old, default=None) is not None else []
        for key, now in found:
            raise ConfigError(f"config key '{key}' ({source}): {why}; it is '{now}' now")


def _validate(obj: Any, path: tuple[str, ...] = ()) -> None:
    """Run `validate()` on the config and every nested dataclass section that has one."""
    if not dataclasses.is_dataclass(obj):
        return
    for f in dataclasses.fields(obj):
        _validate(getattr(obj, f.name), (*path, f.name))
    if not callable(getattr(obj, "validate", None)):
        return
    try:
        obj.validate()
    except ConfigError as e:
        if len(path) < 2:
            raise
        # A section names its keys as `<section>.<key>` (its class's KEY, else its field's name);
        # nested deeper (eval.dataset, ppo.critic), they get the full path.
        name = getattr(type(obj), "KEY", path[-1])
        full = re.sub(rf"(config keys? '|' and ')({re.escape(name)})\.", rf"\1{'.'.join(path)}.", str(e))
        raise ConfigError(full) from None


SECRET_KEYS = ("api_key",)  # config keys whose values leave the run's directory masked


def without_secrets(cfg: Any) -> dict[str, Any]:
    """The resolved config as plain data, every SECRET_KEYS value masked: what a run hands a
    metrics backend that uploads it (`wandb sync`), unlike config.yaml, which stays private."""

    def mask(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: "***" if k in SECRET_KEYS and v is not None else mask(v) for k, v in x.items()}
        return [mask(v) for v in x] if isinstance(x, list) else x

    return mask(OmegaConf.to_container(OmegaConf.create(to_yaml(cfg))))


def to_yaml(cfg: Any) -> str:
    """The resolved config as YAML (what a run saves next to its outputs). The keys its
    `validate()` worked out from others (`derived`, e.g. an LR schedule's length from `steps`)
    stay null, so a resumed run with other `steps` works them out again."""
    if dataclasses.is_dataclass(cfg):
        derived = getattr(cfg, "derived", ())
        cfg = OmegaConf.structured(cfg)
        for key in derived:
            OmegaConf.update(cfg, key, None)
    return OmegaConf.to_yaml(cfg, resolve=True)


_RULE = re.compile(r"(>=|>) (\S+)|([\[(])([^,]+), ([^\])]+)([\])])")


def _allows(rule: str, value: float) -> bool:
    if not rule:
        return True
    m = _RULE.fullmatch(rule)
    if m is None:
        raise ValueError(f"check_range: {rule!r} is not '>= LOW', '> LOW' or an interval '[LOW, HIGH)'")
    op, low, left, lo, hi, right = m.groups()
    if op:
        return value >= float(low) if op == ">=" else value > float(low)
    above = value >= float(lo) if left == "[" else value > float(lo)
    return above and (value <= float(hi) if right == "]" else value < float(hi))


def check_range(key: str, value: Any, rule: str = "") -> None:
    """For `validate()` methods: config key `key` must be a finite number that `rule` allows:
    ">= LOW", "> LOW", or an interval "[LOW, HIGH)" (a bracket takes its end in, a parenthesis
    leaves it out); "" any finite number. NaN and infinity fail every rule (`value < low` is
    False for NaN, which is why the checks go through here)."""
    finite = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if finite and _allows(rule, value):
        return
    must = f"in {rule}" if rule[:1] in ("[", "(") else rule
    must = must if finite else f"a finite number {must}".rstrip()
    raise ConfigError(f"config key '{key}' must be {must}, got {value}")


def check_ranges(section: Any, prefix: str, rule: str, keys: Sequence[str]) -> None:
    """`check_range` of each of `keys` of `section` (a config dataclass), named `prefix` + key."""
    for key in keys:
        check_range(f"{prefix}{key}", getattr(section, key), rule)


def check_choice(key: str, value: Any, choices: Sequence[str]) -> None:
    """For `validate()` methods: config key `key` must be one of `choices`."""
    if value not in choices:
        raise ConfigError(f"config key '{key}': {value!r} is not one of {', '.join(choices)}")


def require_file(key: str, value: str | Path) -> None:
    """For `validate()` methods: config key `key` must name an existing file."""
    if not Path(value).is_file():
        raise ConfigError(f"config key '{key}': file not found: {value}")


def import_object(key: str, path: str) -> Any:
    """The object a "package.module:name" config value names (a custom reward, rollout, ...)."""
    import importlib

    module, _, name = path.partition(":")
    if not module or not name:
        raise ConfigError(f"config key {key!r}: expected 'package.module:name', got {path!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        # `python -m` puts the working directory on sys.path, the `forge` console script does not:
        # a user's module beside their config imports the same either way.
        sys.path.insert(0, os.getcwd())
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"config key {key!r}: cannot import {path!r}: {_first_line(e)}") from None
