"""Throwaway non-root users for the least-privilege tests, and a Python they can run.

The tests run the engine as one new user and the recorder as another, holding only the
capabilities docs/privileges.md names (setpriv ambient capabilities). Both need this project's
interpreter, venv and source; on a CI runner or a developer's machine some of them may sit under a
directory only root may enter (/root/.pyenv, a clone in /root). Whatever of those another user
cannot reach is mirrored into a workspace every user may enter: hard links where the file system
allows (instant, and the same files), copies elsewhere. The interpreter is run as a virtual
environment whose pyvenv.cfg points at its mirrored home, so paths stay consistent."""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import stat
import subprocess
import sys
import sysconfig
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def reachable_by_others(path: Path) -> bool:
    """Whether a user who is neither the owner nor in the group may read `path` (every directory
    above it searchable by others, and the file itself readable)."""
    p = path.resolve()
    for d in [*reversed(p.parents), p]:
        mode = d.stat().st_mode
        need = stat.S_IXOTH if stat.S_ISDIR(mode) else stat.S_IROTH
        if not mode & need:
            return False
    return True


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links refused (fs.protected_hardlinks): a copy
        shutil.copy2(src, dst)


def _mirror(src: Path, dst: Path, skip: Callable[[str, list[str]], Iterable[str]] | None = None) -> None:
    shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy, ignore=skip)


@dataclass(frozen=True)
class SharedPython:
    """How another user runs this project's Python: argv prefix and environment."""

    python: Path
    env: dict[str, str]


def shared_python(workspace: Path) -> SharedPython:
    """This interpreter, venv and source, as every user may run them (mirrored into
    `workspace`, a directory every user may enter, only where they cannot be reached)."""
    env: dict[str, str] = {}
    base = Path(sys.base_prefix)
    stdlib = Path(sysconfig.get_path("stdlib"))
    site = Path(sysconfig.get_path("purelib"))
    exe = Path(sys.executable)
    if all(reachable_by_others(p) for p in (exe, stdlib, Path(os.__file__), site)):
        python = exe
    else:
        home = workspace / "python"
        (home / "bin").mkdir(parents=True)
        real = Path(os.path.realpath(sys.executable))
        _link_or_copy(str(real), str(home / "bin" / real.name))
        libdir = Path(sysconfig.get_config_var("LIBDIR") or base / "lib")
        (home / "lib").mkdir()
        for so in libdir.glob("libpython*.so*"):  # a shared-library build's libpython
            if so.is_symlink():
                (home / "lib" / so.name).symlink_to(os.readlink(so))
            else:
                _link_or_copy(str(so), str(home / "lib" / so.name))
        # the standard library without its tests and without the base's own site-packages
        _mirror(
            stdlib,
            home / "lib" / stdlib.name,
            lambda d, names: [n for n in names if d == str(stdlib) and n in ("site-packages", "test")],
        )
        venv = workspace / "venv"
        (venv / "bin").mkdir(parents=True)
        (venv / "bin" / "python").symlink_to(home / "bin" / real.name)
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        (venv / "pyvenv.cfg").write_text(
            f"home = {home / 'bin'}\ninclude-system-site-packages = false\nversion = {version}\n"
        )
        lib = venv / "lib" / f"python{version}"
        lib.mkdir(parents=True)
        if reachable_by_others(site):
            (lib / "site-packages").symlink_to(site)
        else:
            _mirror(site, lib / "site-packages")
        # the interpreter's RUNPATH names the unreachable original directory
        env["LD_LIBRARY_PATH"] = str(home / "lib")
        python = venv / "bin" / "python"
    source = ROOT
    if not reachable_by_others(ROOT / "sparseety_prof" / "__init__.py"):
        source = workspace / "source"
        source.mkdir()
        _mirror(ROOT / "sparseety_prof", source / "sparseety_prof")
        _mirror(ROOT / "tests" / "engines", source / "tests" / "engines")
    # first on the path: ahead of the venv's editable-install finder, which points at ROOT
    env["PYTHONPATH"] = str(source)
    env["SPARSEETY_TEST_SOURCE"] = str(source)
    return SharedPython(python, env)


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    home: Path  # a directory of its own (0700): its cache, its outputs

    def run_as(self, caps: Iterable[str] = (), env: dict[str, str] | None = None) -> list[str]:
        """argv prefix that runs a command as this user, holding exactly `caps` (names as
        setpriv spells them: "sys_admin") in every set, ambient included, and nothing else."""
        setpriv = shutil.which("setpriv")
        assert setpriv, "setpriv (util-linux) is part of the base system"
        held = "".join(f",+{c}" for c in caps)
        argv = [setpriv, f"--reuid={self.uid}", f"--regid={self.gid}", "--init-groups"]
        argv += [f"--inh-caps=-all{held}", f"--bounding-set=-all{held}"]
        if held:
            argv.append(f"--ambient-caps=-all{held}")
        values = {
            "HOME": str(self.home),
            "XDG_CACHE_HOME": str(self.home / ".cache"),
            "PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
            **(env or {}),
        }
        return [*argv, "/usr/bin/env", "-i", *(f"{k}={v}" for k, v in values.items())]


def make_user(prefix: str, workspace: Path) -> User:
    """A new system user with no login shell and a private directory in `workspace`."""
    name = f"{prefix}-{secrets.token_hex(4)}"
    subprocess.run(
        ["useradd", "--system", "--user-group", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
        check=True,
        capture_output=True,
        timeout=60,
    )
    pw = pwd.getpwnam(name)
    home = workspace / name
    home.mkdir(mode=0o700)
    os.chown(home, pw.pw_uid, pw.pw_gid)
    return User(name, pw.pw_uid, pw.pw_gid, home)


def remove_user(user: User) -> None:
    subprocess.run(["userdel", user.name], check=True, capture_output=True, timeout=60)
