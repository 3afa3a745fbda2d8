"""The job's options as dotted keys (``model.d_model``): help, types, TOML, overrides.

A key is ``section.field`` of :class:`~zerobubble.train.config.TrainConfig`, or
``table.key`` of torchtitan's tables (:mod:`zerobubble.train.titan`). Its help
is the field's docstring, read from the source with :mod:`ast`, so every option is
documented once, where it is defined; its type is the field's annotation. The command
line (:mod:`zerobubble.cli`) and TOML files (``zerobubble bench --config job.toml``)
both go through here, so they accept exactly the same keys and values.
"""

from __future__ import annotations

import ast
import difflib
import inspect
import itertools
import tomllib
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path

from zerobubble.schedule.textfile import read_text
from zerobubble.train import titan
from zerobubble.train.config import TrainConfig, scaled_defaults

_TRUE, _FALSE, _NONE = ("true", "yes", "1"), ("false", "no", "0"), ("none", "null")


@dataclass(frozen=True)
class Option:
    """One setting of the job: ``section.field``, its type, default and help."""

    key: str
    kind: type
    """int, float, bool or str."""
    optional: bool
    """None (written ``none``) is allowed."""
    default: object
    doc: str
    aliases: tuple[str, ...] = ()
    """Older flags that set it too (``-p``, ``--layers``...): scripts depend on them."""

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    def parse(self, text: str) -> object:
        """The value of command-line ``text``; ValueError says what was expected."""
        low = text.strip().lower()
        if self.optional and low in _NONE:
            return None
        try:
            if self.kind is bool:
                if low in _TRUE + _FALSE:
                    return low in _TRUE
                raise ValueError
            return self.kind(text)
        except ValueError:
            raise ValueError(f"expected {self._expected()}, got {text!r}") from None

    def check(self, value: object, source: str) -> object:
        """A TOML value, type-checked (an int field refuses 0.7 rather than rounding it)."""
        if self.optional and isinstance(value, str) and value.lower() in _NONE:
            return None
        ok = (
            isinstance(value, self.kind) and not (self.kind is not bool and isinstance(value, bool))
        ) or (self.kind is float and isinstance(value, int) and not isinstance(value, bool))
        if not ok:
            raise ValueError(f"{source}: {self.key} must be {self._expected()}, got {value!r}")
        if self.kind is float and isinstance(value, int):  # TOML's 2 for a float field
            return float(value)
        return value

    def _expected(self) -> str:
        name = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
        return name[self.kind] + (" or none" if self.optional else "")


def field_docs(cls: type) -> dict[str, str]:
    """``field -> docstring`` of a dataclass, from the string literal after each field."""
    try:
        tree = ast.parse(inspect.cleandoc("\n" + inspect.getsource(cls)))
    except (OSError, TypeError):  # no source (frozen build): options keep working without help
        return {}
    node = tree.body[0]
    assert isinstance(node, ast.ClassDef)  # the source of a class is its class statement
    docs = {}
    for stmt, nxt in itertools.pairwise(node.body):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _kind(annotation: object) -> tuple[type, bool]:
    args = typing.get_args(annotation)
    if isinstance(annotation, types.UnionType) and type(None) in args:
        (inner,) = (a for a in args if a is not type(None))
        return inner, True
    if not isinstance(annotation, type):
        raise TypeError(
            f"a config field is annotated {annotation!r}; options take int, float, bool or str, "
            "optionally | None"
        )
    return annotation, False


def _sections() -> dict[str, type]:
    return typing.get_type_hints(TrainConfig)


def options() -> tuple[Option, ...]:
    """Every option: the job's own (:class:`TrainConfig`, section by section, in field
    order), then torchtitan's keys (:mod:`zerobubble.train.titan`), table by table."""
    defaults = TrainConfig()
    tables = [(s, cls, getattr(defaults, s)) for s, cls in _sections().items()]
    tables += [(t, cls, cls()) for t, cls in titan.TABLES.items()]
    return table_options(tables)


def table_options(tables: Iterable[tuple[str, type, object]]) -> tuple[Option, ...]:
    """One :class:`Option` per field of each ``(table name, dataclass, default instance)``
    (fields whose metadata says ``option: False`` left out): shared by the benchmark's
    options and the trainer's recipe (:mod:`zerobubble.train.recipe`)."""
    out = []
    for section, cls, default in tables:
        hints, docs = typing.get_type_hints(cls), field_docs(cls)
        for f in fields(cls):
            if not f.metadata.get("option", True):
                continue
            kind, optional = _kind(hints[f.name])
            out.append(
                Option(
                    f"{section}.{f.name}",
                    kind,
                    optional,
                    getattr(default, f.name),
                    docs.get(f.name, ""),
                    tuple(f.metadata.get("aliases", ())),
                )
            )
    return tuple(out)


def closest(word: str, valid: Iterable[str]) -> str:
    """``; did you mean X?`` for the valid name nearest ``word``, or nothing."""
    found = difflib.get_close_matches(word, list(valid), n=1, cutoff=0.6)
    return f"; did you mean {found[0]!r}?" if found else ""


def load_toml(path: str | Path) -> dict[str, object]:
    """The options a TOML file sets, as ``{key: value}`` (torchtitan's keys mapped onto
    the job's, :func:`zerobubble.train.titan.to_job`); errors name the file, the key and
    the closest valid one."""
    return titan.to_job(read_toml(path, options()), str(path))


def read_toml(path: str | Path, valid: Iterable[Option]) -> dict[str, object]:
    """The ``valid`` options a TOML file sets, as ``{table.key: value}``, type-checked;
    ValueError naming the file, the unknown table or key and the closest valid one."""
    p = Path(path)
    try:
        data = tomllib.loads(read_text(p, "config file"))
    except tomllib.TOMLDecodeError as exc:  # its message carries the line and column
        raise ValueError(f"{p}: not valid TOML: {exc}") from None
    known = {o.key: o for o in valid}
    tables = list(dict.fromkeys(k.split(".")[0] for k in known))
    out: dict[str, object] = {}
    for name, table in data.items():
        if name not in tables or not isinstance(table, dict):
            raise ValueError(
                f"{p}: {name!r} is not a section{closest(name, tables)}; expected tables "
                f"[{'], ['.join(tables)}]"
            )
        for field_name, value in table.items():
            key = f"{name}.{field_name}"
            if key not in known:
                mine = [k.split(".")[1] for k in known if k.startswith(name + ".")]
                hint = closest(field_name, mine) or closest(key, known)
                raise ValueError(
                    f"{p}: unknown key {key!r}{hint} ([{name}] takes {', '.join(mine)})"
                )
            out[key] = known[key].check(value, str(p))
    return out


def build_config(
    values: Mapping[str, object], *, devices: int, profile_only: bool = False
) -> TrainConfig:
    """A :class:`TrainConfig` from ``values`` (``{key: value}``, the job's keys or
    torchtitan's, later sources already merged over earlier ones by
    :func:`zerobubble.train.titan.overlay`); ``devices`` is P when ``values`` does not
    set it, and the defaults that scale with P follow
    (:func:`~zerobubble.train.config.scaled_defaults`)."""
    known = {o.key for o in options()}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown option(s) {unknown}; see zerobubble bench --help")
    values = titan.resolve_batch(titan.to_job(values, "options"))
    P = values.get("schedule.devices", devices)
    if not isinstance(P, int) or isinstance(P, bool):
        raise ValueError(f"schedule.devices must be an integer, got {P!r}")
    merged = {**scaled_defaults(P), "schedule.devices": P, **values}
    if profile_only:
        merged["job.profile_only"] = True
    by_section: dict[str, dict[str, object]] = {}
    for key, value in merged.items():
        section, name = key.split(".")
        by_section.setdefault(section, {})[name] = value
    return TrainConfig(**{n: cls(**by_section.get(n, {})) for n, cls in _sections().items()})
