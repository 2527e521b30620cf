"""The render asks of the images only what they provide, for every value set:

- every image reference is one the project builds (``<IMAGE_REGISTRY>/amprl-cpu`` or
  ``amprl-cuda`` at the package version, or pinned by digest: the Makefile's registry and
  the Dockerfiles' titles) or the documented Redis image (values.yaml's ``redis.image``:
  the official image, Redis 7, whose config syntax redis.conf uses);
- every container's command (with the image's ENTRYPOINT and CMD where the pod leaves
  them, as Kubernetes does) and every exec probe is an entry point the image has:
  ``amprl <subcommand>`` of ``amprl.cli.SERVICES`` with flags that subcommand declares, or
  ``python -m <module of amprl>``; on the Redis image, ``sh -c`` scripts calling only
  busybox tools and the Redis binaries (``REDIS_IMAGE_TOOLS``);
- every ``AMPRL_*`` variable a container gets is one the code reads (a string constant of
  that name in ``src/amprl``, outside docstrings) or one that builds another variable
  through Kubernetes' ``$(NAME)`` (AMPRL_SHARD_INDEX in AMPRL_REDIS_URL).

``contract_problems`` returns what does not match; the negative cases below change one
thing in a render and expect it named. ``make pod-check`` then runs the same render's
commands in the built image (tests/podman).
"""

from __future__ import annotations

import ast
import copy
import importlib.util
import re
import tomllib
from dataclasses import dataclass
from functools import cache

import pytest
import yaml

from amprl.cli import SERVICES
from chartkit import CHART, ROOT, VALUE_SETS

# What docker.io/library/redis:7-alpine has for a pod's scripts: busybox's shell and tools,
# and Redis's own binaries.
REDIS_IMAGE_TOOLS = frozenset({"sh", "cat", "printf", "sha256sum", "cut", "grep", "test", "[", "echo",
                               "redis-server", "redis-cli", "redis-check-aof", "redis-check-rdb"})
# Shell words before a command, and shell builtins and keywords that are no command of
# the image.
SHELL_PREFIXES = frozenset({"exec", "if", "then", "else", "elif", "do", "while", "until", "!", "{", "time"})
SHELL_BUILTINS = frozenset({"set", "umask", "export", "local", "return", "shift", "cd", "fi", "done", "esac",
                            "}", "true", "false", ":", "read", "trap", "wait", "exit"})


@dataclass(frozen=True)
class Image:
    repository: str
    tag: str
    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...]
    kind: str  # amprl, redis


def _dockerfile_runtime(path) -> tuple[tuple[str, ...], tuple[str, ...], str]:
    """(ENTRYPOINT, CMD, title label) of a Dockerfile's last stage (exec form)."""
    text = path.read_text().replace("\\\n", " ")
    last = text[text.rindex("\nFROM "):]
    # HEALTHCHECK's own CMD is not the image's
    last = re.sub(r"HEALTHCHECK[^\n]*", "", last)
    entry = re.findall(r"^ENTRYPOINT (\[.*\])$", last, re.M)
    cmd = re.findall(r"^CMD (\[.*\])$", last, re.M)
    title = re.search(r'org\.opencontainers\.image\.title="([^"]+)"', last)
    assert entry and cmd and title, path
    return tuple(yaml.safe_load(entry[-1])), tuple(yaml.safe_load(cmd[-1])), title.group(1)


@cache
def project_images() -> tuple[Image, ...]:
    """The images the project builds (`make images`) and the Redis image values.yaml names."""
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    registry = re.search(r"^IMAGE_REGISTRY \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    images = []
    for flavour in ("cpu", "cuda"):
        entry, cmd, title = _dockerfile_runtime(ROOT / "docker" / f"Dockerfile.{flavour}")
        images.append(Image(f"{registry}/{title}", version, entry, cmd, "amprl"))
    redis = yaml.safe_load((CHART / "values.yaml").read_text())["redis"]["image"]
    # The official image's ENTRYPOINT is its docker-entrypoint.sh, which runs a given command.
    images.append(Image(redis["repository"], redis["tag"], ("docker-entrypoint.sh",), ("redis-server",), "redis"))
    return tuple(images)


def image_of(reference: str) -> Image | None:
    """The project's image a reference names: repository:tag, repository@digest or both."""
    m = re.fullmatch(r"([^@]+?)(?::([\w][\w.-]*))?(?:@(sha256:[0-9a-f]{64}))?", reference)
    if not m:
        return None
    repository, tag, digest = m.groups()
    for image in project_images():
        if image.repository == repository and (tag == image.tag or (digest and tag in (None, image.tag))):
            return image
    return None


@cache
def code_env_names() -> frozenset[str]:
    """Every AMPRL_* name that appears as a whole string constant in src/amprl's code
    (docstrings left out: a name only documented is not read)."""
    names = set()
    for path in (ROOT / "src" / "amprl").rglob("*.py"):
        if "v1" in path.relative_to(ROOT / "src" / "amprl").parts:
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                    and re.fullmatch(r"AMPRL_[A-Z0-9_]+", node.value)):
                names.add(node.value)
    return frozenset(names)


@cache
def subcommand_flags(sub: str) -> frozenset[str]:
    """The --flags a subcommand declares: string constants in its module and in the base
    parser every service shares (amprl.common.cli)."""
    module = SERVICES[sub].partition(":")[0]
    flags = set()
    for name in (module, "amprl.common.cli"):
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin, name
        for node in ast.walk(ast.parse(open(spec.origin).read())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"--[a-z][a-z0-9-]*",
                                                                                               node.value):
                flags.add(node.value)
    return frozenset(flags)


def script_commands(script: str) -> set[str]:
    """The commands a POSIX sh script runs: the first word of each simple command, in
    $(...) too, after assignments and ``exec``/``if``/``then``/...; builtins like ``set``
    and the functions the script defines are not commands the image must have. Quotes,
    backslashes and comments are honoured; here-documents and arithmetic are not (the
    chart's scripts have none)."""
    found: set[str] = set()
    functions: set[str] = set()

    def simple_command(words: list[str]) -> None:
        while words:
            first = words[0]
            m = re.fullmatch(r"(\w[\w-]*)\(\)", first)
            if m:
                functions.add(m.group(1))
            elif not (first in SHELL_PREFIXES or re.fullmatch(r"[A-Za-z_]\w*=.*", first, re.S)):
                break
            words = words[1:]
        if words and words[0] not in SHELL_BUILTINS:
            found.add(words[0])

    def parse(i: int, in_substitution: bool) -> int:
        words: list[str] = []
        word: list[str] | None = None
        while i < len(script):
            c = script[i]
            if c == "\\" and i + 1 < len(script):
                word = (word or []) + [script[i + 1]]
                i += 2
            elif c == "'":
                j = script.index("'", i + 1)
                word = (word or []) + [script[i + 1:j]]
                i = j + 1
            elif c == '"':
                word, i = (word or []), i + 1
                while script[i] != '"':
                    if script.startswith("$(", i):
                        i = parse(i + 2, True)
                        word.append("$()")
                    else:
                        word.append(script[i + 1] if script[i] == "\\" else script[i])
                        i += 2 if script[i] == "\\" else 1
                i += 1
            elif script.startswith("$(", i):
                i = parse(i + 2, True)
                word = (word or []) + ["$()"]
            elif c == "#" and word is None:
                end = script.find("\n", i)
                i = len(script) if end < 0 else end
            elif c in " \t\n;&|" or (c == ")" and in_substitution):
                if word is not None:
                    words.append("".join(word))
                    word = None
                if c in "\n;&|)":
                    simple_command(words)
                    words = []
                i += 1
                if c == ")":
                    return i
            else:
                word = (word or []) + [c]
                i += 1
        if word is not None:
            words.append("".join(word))
        simple_command(words)
        return i

    parse(0, False)
    return found - functions


def _argv_problems(where: str, image: Image, argv: list[str]) -> list[str]:
    if not argv:
        return [f"{where}: runs nothing"]
    if image.kind == "redis":
        if argv[:2] != ["sh", "-c"] or len(argv) < 3:
            return [f"{where}: {argv[:3]} is not `sh -c SCRIPT` (what the Redis image is used with)"]
        unknown = script_commands(argv[2]) - REDIS_IMAGE_TOOLS
        return [f"{where}: the Redis image has no {sorted(unknown)}"] if unknown else []
    if argv[0] in ("python", "python3") and argv[1:2] == ["-m"] and len(argv) > 2:
        module = argv[2]
        ok = module.split(".")[0] == "amprl" and importlib.util.find_spec(module) is not None
        return [] if ok else [f"{where}: python -m {module}: no such module in amprl"]
    if argv[0] not in ("amprl", "/opt/venv/bin/amprl"):
        return [f"{where}: {argv[0]!r} is not an entry point of the image (amprl, python -m amprl....)"]
    if len(argv) < 2 or argv[1] not in SERVICES:
        return [f"{where}: amprl {argv[1] if len(argv) > 1 else ''!r} is not a subcommand "
                f"({', '.join(SERVICES)})"]
    flags = {a.split("=")[0] for a in argv[2:] if a.startswith("--")}
    unknown = flags - subcommand_flags(argv[1])
    return [f"{where}: amprl {argv[1]} has no {sorted(unknown)}"] if unknown else []


def pod_specs(docs: list[dict]):
    """(where, pod spec) of every workload's pod template (Jobs and CronJobs too)."""
    for d in docs:
        spec = d.get("spec") or {}
        if d.get("kind") == "CronJob":
            spec = spec.get("jobTemplate", {}).get("spec", {})
        template = spec.get("template") if isinstance(spec, dict) else None
        if isinstance(template, dict) and "spec" in template:
            yield f"{d['kind']} {d['metadata']['name']}", template["spec"]


def contract_problems(docs: list[dict]) -> list[str]:
    """What in the render does not match what the images provide and the code reads."""
    problems = []
    for where, spec in pod_specs(docs):
        for c in [*(spec.get("initContainers") or []), *spec["containers"]]:
            at = f"{where} container {c['name']}"
            image = image_of(c["image"])
            if image is None:
                problems.append(f"{at}: image {c['image']} is not one the project builds "
                                f"({', '.join(f'{i.repository}:{i.tag}' for i in project_images())})")
                continue
            if "command" in c:
                argv = list(c["command"]) + list(c.get("args") or [])
            else:
                argv = list(image.entrypoint) + list(c["args"] if "args" in c else image.cmd)
            if image.kind == "redis" and argv[:1] == ["docker-entrypoint.sh"]:
                argv = argv[1:]
            problems += _argv_problems(at, image, argv)
            for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
                action = (c.get(kind) or {}).get("exec")
                if action:
                    problems += _argv_problems(f"{at} {kind}", image, list(action["command"]))
            for hook, action in ((c.get("lifecycle") or {})).items():
                if "exec" in action:
                    problems += _argv_problems(f"{at} {hook}", image, list(action["exec"]["command"]))
            # A variable that only builds another one through $(NAME) is read by the kubelet.
            expanded = {m for text in [*(str(e.get("value", "")) for e in c.get("env") or []),
                                       *c.get("command", []), *c.get("args", [])]
                        for m in re.findall(r"(?<!\$)\$\((\w+)\)", text)}
            for item in c.get("env") or []:
                name = item["name"]
                if name.startswith("AMPRL_") and name not in code_env_names() | expanded:
                    problems.append(f"{at}: env {name} is read nowhere in src/amprl")
    return problems


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_every_image_command_and_variable_of_the_render_is_one_the_images_provide(rendered, value_set):
    assert contract_problems(rendered[value_set][0]) == []


def test_the_images_the_contract_knows_are_the_built_ones_and_redis_7():
    images = {i.repository: i for i in project_images()}
    cpu = images["ghcr.io/amp-rl/amprl-cpu"]
    assert cpu.entrypoint == ("amprl",) and cpu.cmd == ("--help",)
    assert images["ghcr.io/amp-rl/amprl-cuda"].cmd == ("learner",)
    redis = images["docker.io/library/redis"]
    assert redis.tag.split(".")[0] == "7"  # ACL selectors and `bind * -::*` in redis.conf
    assert {"AMPRL_CONFIG", "AMPRL_REPLAY_ADDRESS", "AMPRL_REDIS_PASSWORD_FILE"} <= code_env_names()


def _container(docs, component: str) -> dict:
    for where, spec in pod_specs(docs):
        if where.endswith(f"-amprl-{component}"):
            return spec["containers"][0]
    raise KeyError(component)


def _break(change):
    def broken(rendered):
        docs = copy.deepcopy(rendered["defaults"][0])
        change(docs)
        return docs
    return broken


@pytest.mark.parametrize("change, expected", [
    (lambda d: _container(d, "actor").update(image="ghcr.io/amp-rl/amprl-cpu:0.0.9"),
     "image ghcr.io/amp-rl/amprl-cpu:0.0.9 is not one the project builds"),
    (lambda d: _container(d, "replay").update(image="docker.io/library/python:3.11"),
     "image docker.io/library/python:3.11 is not one the project builds"),
    (lambda d: _container(d, "learner").update(args=["trainer"]), "amprl 'trainer' is not a subcommand"),
    (lambda d: _container(d, "paramserver").update(args=["paramserver", "--pull-prot", "50056"]),
     "amprl paramserver has no ['--pull-prot']"),
    (lambda d: _container(d, "actor").update(command=["/usr/bin/actor"]),
     "'/usr/bin/actor' is not an entry point of the image"),
    (lambda d: _container(d, "evaluator")["startupProbe"].update(
        exec={"command": ["python", "-m", "amprl.common.healthprobe"]}),
     "python -m amprl.common.healthprobe: no such module in amprl"),
    (lambda d: _container(d, "replay")["env"].append({"name": "AMPRL_REPLAY_SHARDS", "value": "2"}),
     "env AMPRL_REPLAY_SHARDS is read nowhere in src/amprl"),
    (lambda d: _container(d, "redis").update(command=["sh", "-c", "exec valkey-server /etc/redis/redis.conf"]),
     "the Redis image has no ['valkey-server']"),
    (lambda d: _container(d, "redis").update(command=["bash", "-c", "exec redis-server"]),
     "is not `sh -c SCRIPT`"),
])
def test_a_render_that_asks_the_image_for_something_it_lacks_is_named(rendered, change, expected):
    problems = contract_problems(_break(change)(rendered))
    assert len(problems) == 1 and expected in problems[0], problems


def test_script_commands_sees_through_functions_substitutions_and_pipes():
    script = ("set -eu\numask 077\nsha() { printf '%s' \"$(cat \"$1\")\" | sha256sum | cut -d ' ' -f 1; }\n"
              "if [ -s /a ]; then x=\"$(sha /a)\"; fi\nX=1 exec redis-server /etc/redis.conf")
    assert script_commands(script) == {"printf", "cat", "sha256sum", "cut", "[", "redis-server"}
