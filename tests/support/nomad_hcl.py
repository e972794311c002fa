"""A FAKE of Nomad's job parser (``POST /v1/jobs/parse``) for the HCL of the pipeline group's job file,
so a stub of Nomad can turn deploy/nomad/switchboard-pipeline.nomad.hcl into the JSON job Nomad would
(no Nomad or HCL library here).

    job = parse_job(Path("deploy/nomad/switchboard-pipeline.nomad.hcl").read_text())
    job["ID"], [g["Name"] for g in job["TaskGroups"]]      # "switchboard-pp-a", ["stage0", "stage1"]

The subset: blocks with string labels, attributes, strings, heredocs (``<<-EOT``), lists, numbers,
booleans, ``var.NAME`` and products (``1000 * var.NAME``) from the variables' defaults, ``${var.NAME}`` inside strings
(other ``${...}`` are runtime interpolations Nomad leaves alone, and so does this). Only the fields of
Nomad's job JSON that the tests read are filled: ID, Name, Type, Datacenters, Constraints, Meta,
TaskGroups (Name, Count, Services, Tasks with Config, Templates, Resources).
"""

from __future__ import annotations

import json
import math
import re
import textwrap
from typing import Any

_TOKEN = re.compile(
    r"(?P<skip>[ \t\r\n]+|\#[^\n]*|//[^\n]*)"
    r"|<<(?P<dash>-?)(?P<tag>\w+)\n(?P<body>.*?)\n[ \t]*(?P=tag)\b"
    r'|(?P<string>"(?:[^"\\]|\\.)*")'
    r"|(?P<punct>[{}\[\]=,])"
    r'|(?P<word>[^\s{}\[\]=,"]+)',
    re.DOTALL,
)


def _tokens(text: str) -> list[tuple[str, Any, int]]:
    """(kind, value, line) of each token; strings and heredocs as their text."""
    out = []
    for m in _TOKEN.finditer(text):
        line = text.count("\n", 0, m.start())
        if m.lastgroup == "string":
            out.append(("string", json.loads(m.group("string")), line))
        elif m.group("tag"):
            body = m.group("body") + "\n"
            out.append(("string", textwrap.dedent(body) if m.group("dash") else body, line))
        elif m.lastgroup in ("punct", "word"):
            out.append((m.lastgroup, m.group(m.lastgroup), line))
    return out


class _Parser:
    def __init__(self, text: str) -> None:
        self.toks, self.i = _tokens(text), 0

    def body(self, end: str | None) -> dict[str, Any]:
        """Attributes by name; blocks as ``name -> [(labels, body), ...]``."""
        out: dict[str, Any] = {}
        while self.i < len(self.toks) and self.toks[self.i][1] != end:
            _, name, _ = self.toks[self.i]
            self.i += 1
            if self.toks[self.i][1] == "=":
                self.i += 1
                out[name] = self.value()
                continue
            labels = []
            while self.toks[self.i][0] == "string":
                labels.append(self.toks[self.i][1])
                self.i += 1
            assert self.toks[self.i][1] == "{", f"block {name} {labels}: expected {{"
            self.i += 1
            out.setdefault(name, []).append((labels, self.body("}")))
            self.i += 1
        return out

    def value(self) -> Any:
        kind, tok, line = self.toks[self.i]
        self.i += 1
        if kind == "string":
            return tok
        if tok == "[":
            items = []
            while self.toks[self.i][1] != "]":
                items.append(self.value())
                if self.toks[self.i][1] == ",":
                    self.i += 1
            self.i += 1
            return items
        words = [tok]  # an expression: the words on this line
        while self.i < len(self.toks) and self.toks[self.i][0] == "word" and self.toks[self.i][2] == line:
            words.append(self.toks[self.i][1])
            self.i += 1
        return ("expr", words)


def parse_job(text: str) -> dict[str, Any]:
    """The job in `text` as Nomad's JSON job (the subset above)."""
    top = _Parser(text).body(None)
    defaults = {labels[0]: _literal(body.get("default")) for labels, body in top.get("variable", [])}

    def ev(value: Any) -> Any:
        if isinstance(value, tuple):  # ("expr", words)
            words = [defaults[w[4:]] if w.startswith("var.") else _literal(w) for w in value[1]]
            if words[1::2] and set(words[1::2]) == {"*"}:  # a product
                return math.prod(int(w) for w in words[::2])
            assert len(words) == 1, f"unsupported expression {value[1]}"
            return words[0]
        if isinstance(value, str):
            return re.sub(r"\$\{var\.(\w+)\}", lambda m: str(defaults[m.group(1)]), value)
        if isinstance(value, list):
            return [ev(v) for v in value]
        return value

    def attrs(body: dict[str, Any]) -> dict[str, Any]:
        return {k: ev(v) for k, v in body.items() if not isinstance(v, list) or not _is_blocks(v)}

    def blocks(body: dict[str, Any], name: str) -> list[tuple[list[str], dict[str, Any]]]:
        return list(body.get(name, []))

    ((job_id,), job) = top["job"][0]
    return {
        "ID": job_id,
        "Name": job_id,
        "Type": ev(job.get("type", "service")),
        "Datacenters": ev(job.get("datacenters")),
        "Constraints": [
            {"LTarget": ev(c.get("attribute", "")), "RTarget": ev(c.get("value", "")), "Operand": ev(c["operator"])}
            for _, c in blocks(job, "constraint")
        ],
        "Meta": None,
        "TaskGroups": [
            {
                "Name": name,
                "Count": ev(group.get("count", 1)),
                "Services": [
                    {
                        "Name": ev(s["name"]),
                        "PortLabel": ev(s.get("port", "")),
                        "Provider": ev(s.get("provider", "consul")),
                        "Meta": next((attrs(m) for _, m in blocks(s, "meta")), None),
                    }
                    for _, s in blocks(group, "service")
                ],
                "Tasks": [
                    {
                        "Name": task_name,
                        "Driver": ev(task["driver"]),
                        "Config": next((attrs(c) for _, c in blocks(task, "config")), {}),
                        "Templates": [
                            {
                                "EmbeddedTmpl": ev(t.get("data")),
                                "DestPath": ev(t.get("destination")),
                                "Envvars": ev(t.get("env", False)),
                                "ChangeMode": ev(t.get("change_mode", "restart")),
                                "ErrMissingKey": ev(t.get("error_on_missing_key", False)),
                            }
                            for _, t in blocks(task, "template")
                        ],
                        "Resources": next(
                            ({"CPU": ev(r.get("cpu")), "MemoryMB": ev(r.get("memory"))}
                             for _, r in blocks(task, "resources")),
                            None,
                        ),
                    }
                    for (task_name,), task in blocks(group, "task")
                ],
            }
            for (name,), group in blocks(job, "group")
        ],
    }


def _is_blocks(value: list[Any]) -> bool:
    return bool(value) and all(isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], dict) for v in value)


def _literal(word: Any) -> Any:
    if isinstance(word, tuple):  # a variable's default that is itself an expression (a list, a type)
        return _literal(word[1][0])
    if word in ("true", "false"):
        return word == "true"
    return int(word) if isinstance(word, str) and word.isdigit() else word
