"""What ``pip install leasekeeper`` gives: the client alone, the server as an extra, and a
wheel and an sdist ready to publish."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

from tests._docs import ROOT
from tests._server import running_server
from tests.conftest import import_or_skip

pytestmark = pytest.mark.slow

#: The server's packages ([server] and [postgres] in pyproject.toml, and pydantic's and
#: psycopg's compiled parts), by distribution name and by the name they are imported as.
SERVER_PACKAGES = {
    "flask": "flask",  # installed with flask-swagger-ui, never imported
    "flask-swagger-ui": "flask_swagger_ui",
    "httptools": "httptools",
    "mcp": "mcp",
    "msgspec": "msgspec",
    "orjson": "orjson",
    "prometheus-client": "prometheus_client",
    "psycopg": "psycopg",
    "psycopg-binary": "psycopg_binary",
    "psycopg-pool": "psycopg_pool",
    "pydantic": "pydantic",
    "pydantic-core": "pydantic_core",
    "starlette": "starlette",
    "uvicorn": "uvicorn",
    "uvloop": "uvloop",
}
#: In [server] too, but httpx needs them as well: the base install has them.
ALSO_THE_CLIENTS = {"anyio", "typing-extensions"}
SERVER_COMMANDS = ["cleanup", "fence", "mcp", "serve"]
INSTALL_LINE = re.compile(
    r"^(?:python -m )?leasekeeper(?:\.cli)? (\w+) needs the server, which is not installed "
    r"\(no module named '[\w.]+'\): pip install 'leasekeeper\[server\]'\n\Z"
)


def requirement_name(requirement: str) -> str:
    name = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert name, requirement
    return re.sub(r"[-_.]+", "-", name.group()).lower()


def test_the_base_install_asks_for_httpx_httpcore_click_and_sniffio_alone() -> None:
    """``dependencies`` is the client's; every package of [server] and [postgres] is one
    the base-install test below checks is neither installed nor imported by the client."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert sorted(map(requirement_name, project["dependencies"])) == [
        "click",
        "httpcore",
        "httpx",
        "sniffio",
    ]
    extras = project["optional-dependencies"]
    server = {requirement_name(r) for r in extras["server"] + extras["postgres"]}
    assert server - ALSO_THE_CLIENTS <= SERVER_PACKAGES.keys()
    assert "leasekeeper[server,postgres]" in extras["dev"]  # make test: all of it


def test_the_command_names_the_server_commands_it_loads() -> None:
    """``leasekeeper.cli`` lists the server's commands without importing them: the names
    it holds are the commands ``leasekeeper._server_cli`` defines."""
    from leasekeeper import _server_cli, cli

    assert sorted(_server_cli.SERVER_COMMANDS) == list(cli._SERVER_COMMANDS) == SERVER_COMMANDS
    for name, command in _server_cli.SERVER_COMMANDS.items():
        assert command.name == name


def without(modules: list[str], code: str) -> subprocess.CompletedProcess[str]:
    """``code`` run by this interpreter as if ``modules`` were not installed."""
    block = f"import sys; sys.modules.update(dict.fromkeys({modules!r}))\n"
    return subprocess.run(
        [sys.executable, "-c", block + code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    )


def test_without_the_server_its_names_say_how_to_install_it() -> None:
    """``import leasekeeper`` gives the client; a name of the server is an ImportError
    that names ``pip install 'leasekeeper[server]'``; the middlewares still load."""
    done = without(
        ["msgspec", "orjson", "pydantic", "starlette"],
        "import leasekeeper\n"
        "from leasekeeper import LeaseClient, AsyncLeaseClient, IdempotencyMiddleware\n"
        "for name in ('LeaseService', 'Reply', 'Store', 'open_store'):\n"
        "    try:\n"
        "        getattr(leasekeeper, name)\n"
        "    except ImportError as error:\n"
        "        print(error)\n"
        "try:\n"
        "    from leasekeeper import LeaseService\n"
        "except ImportError as error:\n"
        "    print(error)\n",
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 5
    names = ["LeaseService", "Reply", "Store", "open_store", "LeaseService"]
    for line, name in zip(lines, names, strict=True):
        assert line.startswith(f"leasekeeper.{name} needs the server, which is not installed")
        assert line.endswith(": pip install 'leasekeeper[server]'")


def test_a_missing_module_of_leasekeeper_itself_is_not_told_as_the_extra() -> None:
    """Only a package from outside is a missing extra: a module of leasekeeper's own that
    cannot be found is a bug, raised as it is."""
    from leasekeeper._extras import ServerMissing, import_server

    with pytest.raises(ModuleNotFoundError) as raised:
        import_server("leasekeeper._no_such_module", "this")
    assert not isinstance(raised.value, ServerMissing)


def test_without_the_server_its_commands_exit_2_in_one_line() -> None:
    """Each server command, with any arguments (``--help`` too), prints one line naming
    the install command and exits 2; ``--help`` still lists every command."""
    for command in SERVER_COMMANDS:
        done = without(
            ["orjson", "msgspec"],
            f"from leasekeeper.cli import main; main([{command!r}, '--store', 'memory://', "
            "'--help'], prog_name='leasekeeper')",
        )
        assert done.returncode == 2, (command, done.stderr)
        assert done.stdout == ""
        assert INSTALL_LINE.match(done.stderr), done.stderr
        assert INSTALL_LINE.match(done.stderr)[1] == command  # type: ignore[index]
    listing = without(["orjson"], "from leasekeeper.cli import main; main(['--help'])")
    assert listing.returncode == 0, listing.stderr
    listed = re.findall(r"^  (\w+) ", listing.stdout, re.MULTILINE)
    client = ["namespace", "acquire", "renew", "release", "complete", "run"]
    assert listed == sorted([*SERVER_COMMANDS, *client])


def test_python_m_leasekeeper_is_the_command() -> None:
    """``python -m leasekeeper`` runs the ``leasekeeper`` command."""
    done = subprocess.run(
        [sys.executable, "-m", "leasekeeper", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Usage: python -m leasekeeper [OPTIONS] COMMAND")
    assert "  serve      Run the HTTP API (and MCP at /mcp)." in done.stdout


# -- what is built and published -----------------------------------------------------------------


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist ``python -m build`` makes of this checkout, and the wheel it then builds
    from that sdist (so the sdist holds what a build needs)."""
    import_or_skip("build")
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def wheel(dist: Path) -> Path:
    (found,) = dist.glob("leasekeeper-*.whl")
    return found


def sdist(dist: Path) -> Path:
    (found,) = dist.glob("leasekeeper-*.tar.gz")
    return found


def package_files() -> set[str]:
    """Every file of the package in this checkout, relative to src/."""
    src = ROOT / "src"
    return {
        path.relative_to(src).as_posix()
        for path in (src / "leasekeeper").rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }


def test_the_sdist_and_the_wheel_pass_twine_check(dist: Path) -> None:
    """``twine check --strict``: what PyPI would take, its README rendered as Markdown."""
    import_or_skip("twine")
    done = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", str(wheel(dist)), str(sdist(dist))],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("PASSED") == 2, done.stdout


def test_the_wheel_ships_the_package_its_data_and_the_client_alone_as_requirements(
    dist: Path,
) -> None:
    """Every file of the package (the key-guessing word list, ``py.typed``) and nothing
    else; the command's entry point; metadata that asks for httpx, httpcore, click and
    sniffio, the server's packages under the ``server`` extra."""
    with zipfile.ZipFile(wheel(dist)) as archive:
        names = set(archive.namelist())
        metadata = Parser().parsestr(archive.read(_dist_info(names, "METADATA")).decode())
        entry_points = archive.read(_dist_info(names, "entry_points.txt")).decode()
    shipped = {name for name in names if not name.startswith("leasekeeper-")}
    assert shipped == package_files()
    assert {"leasekeeper/_core/keyguess_words.txt", "leasekeeper/py.typed"} <= shipped
    assert "leasekeeper = leasekeeper.cli:main" in entry_points
    assert metadata["Description-Content-Type"] == "text/markdown"
    assert metadata["License-Expression"] == "MIT"
    assert _dist_info(names, "licenses/LICENSE")
    base = sorted(r for r in metadata.get_all("Requires-Dist") if "extra ==" not in r)
    assert [requirement_name(r) for r in base] == ["click", "httpcore", "httpx", "sniffio"]
    assert {"server", "postgres", "dev"} <= set(metadata.get_all("Provides-Extra"))
    assert "Programming Language :: Python :: 3.11" in metadata.get_all("Classifier")


def _dist_info(names: set[str], name: str) -> str:
    (found,) = (n for n in names if re.fullmatch(rf"leasekeeper-[^/]+\.dist-info/{name}", n))
    return found


def test_the_sdist_holds_the_source_and_none_of_a_checkouts_state(dist: Path) -> None:
    """The package, pyproject.toml, the README and the LICENSE; no virtual environment,
    built site, database or cache."""
    with tarfile.open(sdist(dist)) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {f"src/{name}" for name in package_files()} <= names
    assert {"pyproject.toml", "README.md", "LICENSE", "PKG-INFO"} <= names
    for name in names:
        assert not name.startswith((".venv/", "site/", "dist/", "tests/", "bench/")), name
        assert not name.endswith((".db", ".db-wal", ".pyc")), name


# -- the base install in a virtual environment of its own -----------------------------------------

#: Run by the base install's interpreter: the client, its commands and the middlewares
#: against a real server, then the names of every module that was imported.
CLIENT_SESSION = """
import asyncio
import json
import os
import sqlite3
import sys

import leasekeeper
from leasekeeper import AsyncLeaseClient, IdempotencyMiddleware, LeaseClient
from leasekeeper import WSGIIdempotencyMiddleware
from leasekeeper.cli import main
from leasekeeper.client import FenceGuard

url, modules = sys.argv[1], sys.argv[2]
client = LeaseClient(url)
namespace = client.create_namespace()
os.environ["LEASEKEEPER_NAMESPACE"] = namespace


@client.once(namespace, key="report", fingerprint="v1")
def report() -> dict[str, int]:
    return {"rows": 3}


assert report() == report() == {"rows": 3}


async def held() -> int:
    async with AsyncLeaseClient(url) as aclient:
        async with aclient.lease(namespace, "async-job", ttl=30) as lease:
            await lease.complete({"ok": 1})
            return lease.fencing_token


fence = asyncio.run(held())
db = sqlite3.connect(":memory:")
guard = FenceGuard(db)
guard.create_table()
with db:
    guard.check("invoice", fence)


def cli(*args: str) -> object:
    try:
        main(list(args), prog_name="leasekeeper")
    except SystemExit as done:
        return done.code
    raise AssertionError("click exits")


assert cli("acquire", "--url", url, "--key", "cli-job", "--ttl", "30") == 0
job = [sys.executable, "-c", "print('ran')"]
assert cli("run", "--url", url, "--key", "nightly", "--complete", "--", *job) == 0
assert cli("run", "--url", url, "--key", "nightly", "--complete", "--", *job) == 0
try:
    leasekeeper.LeaseService
except ImportError as error:
    print(error, file=sys.stderr)
with open(modules, "w") as out:
    json.dump(sorted(sys.modules), out)
"""


def in_venv(program: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``program`` of the virtual environment, with none of this session's settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "LEASEKEEPER_"))}
    return subprocess.run(
        [str(program), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=120,
        check=False,
    )


def test_the_base_install_is_the_client_alone(dist: Path, tmp_path: Path) -> None:
    """``pip install leasekeeper`` (the wheel, its requirements from the package index) in
    a fresh virtual environment installs no package of the server's; the client, its
    commands and the middlewares work against a real server importing none of them; a
    server command exits 2 in one line naming the install command."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", wheel(dist)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    names = in_venv(
        python,
        "-c",
        "import importlib.metadata as m, json\n"
        "print(json.dumps(sorted(d.metadata['Name'].lower() for d in m.distributions())))",
        cwd=tmp_path,
    )
    distributions = {requirement_name(name) for name in json.loads(names.stdout)}
    assert {"leasekeeper", "httpx", "click"} <= distributions
    assert distributions.isdisjoint(SERVER_PACKAGES), distributions

    (tmp_path / "session.py").write_text(CLIENT_SESSION)
    modules = tmp_path / "modules.json"
    with running_server(f"sqlite:///{tmp_path / 'lk.db'}", tmp_path / "server.log") as server:
        # -u: the job's line lands after the lines printed before it.
        session = in_venv(python, "-u", "session.py", server.url, str(modules), cwd=tmp_path)
        assert session.returncode == 0, session.stdout + session.stderr
        lines = session.stdout.splitlines()
        assert json.loads(lines[0])["status"] == "held"  # acquire
        assert lines[1] == "ran"  # the first run ran the job, the second skipped it
        assert json.loads(lines[2])["skipped"] is True
        assert session.stderr.startswith("leasekeeper.LeaseService needs the server")
        imported = {name.partition(".")[0] for name in json.loads(modules.read_text())}
        assert imported.isdisjoint(SERVER_PACKAGES.values()), imported & set(
            SERVER_PACKAGES.values()
        )

    for argv in (["-m", "leasekeeper", "serve"], ["-m", "leasekeeper.cli", "mcp", "--x"]):
        refused = in_venv(python, *argv, cwd=tmp_path)
        assert refused.returncode == 2, refused.stderr
        assert refused.stdout == ""
        assert INSTALL_LINE.match(refused.stderr), refused.stderr
    command = in_venv(venv / "bin" / "leasekeeper", "serve", "--port", "8787", cwd=tmp_path)
    assert command.returncode == 2
    assert command.stdout == ""
    assert INSTALL_LINE.match(command.stderr), command.stderr
    listing = in_venv(venv / "bin" / "leasekeeper", "--help", cwd=tmp_path)
    assert listing.returncode == 0
    for name in SERVER_COMMANDS:
        assert f"  {name:<10} Needs the server: pip install 'leasekeeper[server]'" in listing.stdout
