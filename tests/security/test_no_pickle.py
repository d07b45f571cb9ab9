"""No pickle anywhere: nothing in engine/, worker/ or producer/ can turn bytes into code or objects
beyond plain data. Everything that crosses Redis is MessagePack; weights are safetensors.

The scan reads Python tokens, so a comment or docstring that merely mentions pickle (e.g. "never
pickle") is fine, while any use in code is an offence: the pickle family of modules, marshal,
shelve, yaml's object-building loaders, bare eval/exec, torch.load, numpy's allow_pickle=True,
transformers' trust_remote_code=True, or a serializer named "pickle"/"yaml" in a string (how Celery
and kombu are told to accept pickle).
"""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "worker", "producer")
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "jsonpickle", "marshal",
                  "shelve", "joblib", "read_pickle", "to_pickle"}
UNSAFE_YAML = {"load", "load_all", "unsafe_load", "unsafe_load_all", "full_load",
               "full_load_all", "Loader", "UnsafeLoader", "FullLoader"}
UNSAFE_SERIALIZER_NAMES = {"pickle", "yaml", "application/x-python-serialize",
                           "application/x-yaml"}


def offences(source: str) -> list[str]:
    """Unsafe deserialization / code execution in Python source, as 'line N: what' strings."""
    toks = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
            if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                              tokenize.DEDENT)]
    found: list[str] = []
    for i, tok in enumerate(toks):
        prev = toks[i - 1].string if i else ""
        prev2 = toks[i - 2].string if i > 1 else ""
        nxt = toks[i + 1].string if i + 1 < len(toks) else ""
        nxt2 = toks[i + 2].string if i + 2 < len(toks) else ""
        where = f"line {tok.start[0]}"
        if tok.type == tokenize.NAME:
            if tok.string in UNSAFE_MODULES:
                found.append(f"{where}: {tok.string}")
            elif prev == "." and prev2 == "yaml" and tok.string in UNSAFE_YAML:
                found.append(f"{where}: yaml.{tok.string}")
            elif tok.string in ("eval", "exec") and prev != "." and nxt == "(":
                found.append(f"{where}: {tok.string}(")
            elif tok.string == "load" and prev == "." and prev2 == "torch":
                found.append(f"{where}: torch.load")
            elif tok.string in ("allow_pickle", "trust_remote_code") and nxt == "=" \
                    and nxt2 == "True":
                found.append(f"{where}: {tok.string}=True")
        elif tok.type == tokenize.STRING and tok.string[-1] in "'\"" and not \
                tok.string.startswith(('"""', "'''")):
            text = tok.string.lstrip("rRbBuU").strip("'\"")
            if text in UNSAFE_SERIALIZER_NAMES:
                found.append(f"{where}: serializer {text!r}")
    return found


def package_sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py"))


def test_the_scan_covers_the_packages() -> None:
    names = {p.relative_to(REPO).as_posix() for p in package_sources()}
    assert {"producer/protocol.py", "producer/client.py", "producer/celery_bridge.py",
            "worker/admission.py", "worker/loop.py", "engine/models/loader.py"} <= names


def test_no_unsafe_deserialization_in_engine_worker_producer() -> None:
    found = {p.relative_to(REPO).as_posix(): offences(p.read_text())
             for p in package_sources()}
    assert {path: what for path, what in found.items() if what} == {}


@pytest.mark.parametrize("source, expected", [
    ("import pickle\n", ["line 1: pickle"]),
    ("from marshal import loads\n", ["line 1: marshal"]),
    ("import cloudpickle as cp\n", ["line 1: cloudpickle"]),
    ("x = pickle.loads(data)\n", ["line 1: pickle"]),
    ("cfg = yaml.load(text)\n", ["line 1: yaml.load"]),
    ("cfg = yaml.load(text, Loader=yaml.Loader)\n", ["line 1: yaml.load", "line 1: yaml.Loader"]),
    ("cfg = yaml.safe_load(text)\n", []),
    ("value = eval(payload)\n", ["line 1: eval("]),
    ("exec(code)\n", ["line 1: exec("]),
    ("model.eval()\n", []),
    ("state = torch.load(path)\n", ["line 1: torch.load"]),
    ("a = np.load(f, allow_pickle=True)\n", ["line 1: allow_pickle=True"]),
    ("t = AutoTokenizer.from_pretrained(d, trust_remote_code=True)\n",
     ["line 1: trust_remote_code=True"]),
    ("app.conf.update(accept_content=['json', 'pickle'])\n", ["line 1: serializer 'pickle'"]),
    ("# never pickle: msgpack only\nx = 1\n", []),
    ('def f():\n    """Decoded strictly (never pickle)."""\n', []),
    ('message = "this is not pickle"\n', []),
])
def test_the_scan_flags_unsafe_code_and_ignores_mentions(source: str,
                                                          expected: list[str]) -> None:
    assert offences(source) == expected
