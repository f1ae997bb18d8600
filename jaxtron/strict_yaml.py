"""YAML as a config file means it: a key given twice is an error, not a silent last-one-wins, and
a number is what it looks like. YAML 1.1 (PyYAML's) reads `0x10` as 16, `010` as 8, `1:30` as 90
`off` as false and `2024-01-01` as a date; here those stay text, so the schema's type check names them, while `true` /
`false`, decimal integers (`1_000` too) and floats read as before."""

from __future__ import annotations

import re

import yaml

INT = re.compile(r"^[-+]?(?:0|[1-9][0-9_]*)$")
BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")


class StrictLoader(yaml.SafeLoader):
    """SafeLoader with decimal-only integers, true/false-only booleans and no duplicate keys."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
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
    return yaml.load(text, Loader=StrictLoader)  # noqa: S506 - a SafeLoader subclass
