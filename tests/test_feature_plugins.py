"""Features that left the core for plugins: run-folder naming (``run_folder``), the run-folder
lock (``run_lock``), the persistent compilation cache switch (``compilation_cache``) and the
logger fan-out (``logger_relay``).
Each is an entry point like any third-party plugin: one installed beside it replaces it."""

from __future__ import annotations

import os
import re
import textwrap
import warnings
from pathlib import Path

import jax
import pytest

import jaxnitro as jn
import jaxnitro.plugin as P
from jaxnitro.events import run_scoped
from jaxnitro.plugin_manager import plugin_manager
from plugin_dist import installed_plugin
from tiny import Tiny, tiny_data

NAMER = textwrap.dedent(
    '''
    """A third-party package naming run folders after the experiment: <run_dir>/<Class>-<n>."""
    import os
    from jaxnitro.plugin import hookimpl

    ASKED = []


    @hookimpl
    def jaxnitro_new_run_folder(root, experiment):
        ASKED.append(root)
        os.makedirs(root, exist_ok=True)
        n = 1
        while True:
            path = os.path.join(root, f"{type(experiment).__name__}-{n}")
            try:
                os.mkdir(path)
                return path
            except FileExistsError:
                n += 1
    '''
)


@pytest.fixture
def namer(tmp_path):
    with installed_plugin(tmp_path / "site", module="jaxnitro_folder_testplugin", source=NAMER,
                          dist="jaxnitro-folder-test", entry="folder_test", version="1.5") as plugin:
        yield plugin


def test_a_third_party_plugin_replaces_the_run_folder_naming(tmp_path, namer):
    runs = tmp_path / "runs"
    first = jn.train(Tiny(max_epochs=1), data=tiny_data(), run_dir=runs, logger="jsonl")
    second = jn.train(Tiny(max_epochs=1), data=tiny_data(), run_dir=runs, logger="jsonl")
    assert (first.run_dir, second.run_dir) == (str(runs / "Tiny-1"), str(runs / "Tiny-2"))
    assert namer.ASKED == [str(runs), str(runs)]  # the run_dir knob, absolute
    assert sorted(os.listdir(runs)) == ["Tiny-1", "Tiny-2"]  # the built-in named nothing
    (params,) = [x["params"] for x in jn.read_jsonl(runs / "Tiny-1" / "metrics.jsonl") if "params" in x]
    assert params["run_dir"] == str(runs / "Tiny-1")  # the logger writes into the folder it named
    (answer,) = [a for a in P.answers_for(first) if a.hook == "jaxnitro_new_run_folder"]
    assert P.answer_source(answer) == "plugin folder_test (jaxnitro-folder-test 1.5)"
    assert "plugin folder_test (jaxnitro-folder-test 1.5)" in str(first)  # print(nitro) names it


def test_the_built_in_names_run_folders_by_time_and_counter(tmp_path):
    n = jn.train(Tiny(max_epochs=1), data=tiny_data(), run_dir=tmp_path, logger=None)
    assert re.fullmatch(r"\d{8}-\d{6}-1", os.path.basename(n.run_dir)) and os.path.dirname(n.run_dir) == str(tmp_path)
    (answer,) = [a for a in P.answers_for(n) if a.hook == "jaxnitro_new_run_folder"]
    assert answer.plugin == "run_folder"


class _NoFolder:
    @jn.hookimpl
    def jaxnitro_new_run_folder(self, root, experiment):
        return os.path.join(root, "never-made")


def test_a_run_folder_answer_that_is_no_folder_is_refused(tmp_path):
    pm = plugin_manager()
    plugin = _NoFolder()
    pm.register(plugin, name="no-folder-test")
    try:
        with pytest.raises(RuntimeError, match="the `jaxnitro_new_run_folder` hook answered .*never-made'"
                                               ", which is no folder. The plugin that answers it must create"):
            jn.train(Tiny(max_epochs=1), data=tiny_data(), run_dir=tmp_path, logger=None)
    finally:
        pm.unregister(plugin)


def test_without_a_run_folder_plugin_train_is_refused_naming_the_hook(tmp_path, disabled):
    disabled("run_folder")
    n = jn.Nitro(Tiny(max_epochs=1), data=tiny_data(), run_dir=tmp_path, logger=None)
    with pytest.raises(RuntimeError) as err:
        n.train()
    assert str(err.value) == (
        "jaxnitro: no plugin names the run folder (hook `jaxnitro_new_run_folder`) (plugins disabled by "
        "JAXNITRO_DISABLE_PLUGINS: run_folder). Enable the built-in `run_folder` plugin, or install one "
        "that answers the hook."
    )
    assert n.status == "failed" and os.listdir(tmp_path) == []


# -- the run-folder lock ------------------------------------------------------------------------

LOCKER = textwrap.dedent(
    '''
    """A third-party package holding run folders its own way: a HELD marker file."""
    import os
    from jaxnitro.plugin import hookimpl

    CALLS = []


    class Hold:
        def __init__(self, folder):
            self.folder = folder
            open(os.path.join(folder, "HELD"), "w").close()

        @hookimpl
        def jaxnitro_run_start(self, run):  # the hold is a plugin of its run
            CALLS.append(("run_start", os.path.basename(run.run_dir)))

        def release(self, status):
            os.remove(os.path.join(self.folder, "HELD"))
            CALLS.append(("release", status))


    @hookimpl
    def jaxnitro_hold_run_folder(folder, dist):
        CALLS.append(("hold", os.path.basename(folder), dist.process_count))
        return Hold(folder)
    '''
)


@pytest.fixture
def locker(tmp_path):
    with installed_plugin(tmp_path / "site", module="jaxnitro_lock_testplugin", source=LOCKER,
                          dist="jaxnitro-lock-test", entry="lock_test", version="2.0") as plugin:
        yield plugin


class _SeesFolder:
    """Notes what the run folder holds at the first epoch's end (while the run writes it)."""

    def __init__(self, fail=False):
        self.seen, self.fail = None, fail

    @jn.hookimpl
    def jaxnitro_epoch_trained(self, run, epoch, step, stats):
        self.seen = sorted(os.listdir(run.run_dir))
        if self.fail:
            raise ValueError("boom")


def test_a_third_party_plugin_replaces_the_run_folder_lock(tmp_path, locker):
    from jaxnitro.plugins.run_folder.lock import LOCK_NAME

    sees = _SeesFolder()
    with run_scoped([sees]):
        n = jn.train(Tiny(max_epochs=1), data=tiny_data(), run_dir=tmp_path, logger=None)
    name = os.path.basename(n.run_dir)
    assert locker.CALLS == [("hold", name, 1), ("run_start", name), ("release", "done")]
    assert "HELD" in sees.seen and LOCK_NAME not in sees.seen  # its hold, not the built-in lock
    assert os.listdir(n.run_dir) == []  # released
    (answer,) = [a for a in P.answers_for(n) if a.hook == "jaxnitro_hold_run_folder"]
    assert P.answer_source(answer) == "plugin lock_test (jaxnitro-lock-test 2.0)"
    assert "plugin lock_test (jaxnitro-lock-test 2.0)" in str(n)  # print(nitro) names it

    locker.CALLS.clear()  # a failed run is released too, with its status; the hold saw only its run
    with run_scoped([_SeesFolder(fail=True)]), pytest.raises(ValueError, match="boom"):
        jn.train(Tiny(max_epochs=2), data=tiny_data(), run_dir=tmp_path, logger=None)
    assert [c[0] for c in locker.CALLS] == ["hold", "run_start", "release"] and locker.CALLS[-1] == ("release", "failed")


def test_the_built_in_lock_is_the_run_lock_plugin_and_exports_its_errors(tmp_path):
    from jaxnitro.plugins.run_folder import lock

    sees = _SeesFolder()
    with run_scoped([sees]):
        n = jn.train(Tiny(max_epochs=1), data=tiny_data(), run_dir=tmp_path, logger=None)
    assert lock.LOCK_NAME in sees.seen and not os.path.exists(os.path.join(n.run_dir, lock.LOCK_NAME))
    (answer,) = [a for a in P.answers_for(n) if a.hook == "jaxnitro_hold_run_folder"]
    assert answer.plugin == "run_lock" and answer.line() == "jaxnitro_hold_run_folder() -> run_lock"
    (info,) = [p for p in jn.plugins_info() if p.name == "run_lock"]
    assert info.module == "jaxnitro.plugins.run_folder.lock" and "jaxnitro_hold_run_folder()" in info.answered
    assert (jn.RunFolderInUse, jn.RunFolderLost) == (lock.RunFolderInUse, lock.RunFolderLost)
    assert issubclass(jn.RunFolderInUse, RuntimeError) and issubclass(jn.RunFolderLost, RuntimeError)
    held = lock.hold_run_folder(str(tmp_path))
    assert isinstance(held, P.RunFolderHold)
    held.release("done")
    assert not os.path.exists(tmp_path / lock.LOCK_NAME)


def test_without_the_lock_plugin_a_run_writes_its_folder_unlocked_and_says_so(tmp_path, disabled):
    disabled("run_lock")
    sees = _SeesFolder()
    with warnings.catch_warnings(record=True) as caught, run_scoped([sees]):
        warnings.simplefilter("always")
        n = jn.train(Tiny(max_epochs=1), data=tiny_data(), run_dir=tmp_path, logger=None)
    unlocked = [w for w in caught if "unlocked" in str(w.message)]
    assert [str(w.message) for w in unlocked] == [
        f"jaxnitro: no plugin holds the run folder {n.run_dir} (hook `jaxnitro_hold_run_folder`) (plugins "
        f"disabled by JAXNITRO_DISABLE_PLUGINS: run_lock), so this run writes it unlocked: another run writing "
        f"the same folder (a second resume=\"auto\" of a run still running) is not refused, and the folder "
        f"deleted mid-run is not noticed. Enable the built-in `run_lock` plugin, or install one that answers "
        f"the hook."
    ]
    assert unlocked[0].category is RuntimeWarning
    assert n.status == "done" and sees.seen == []  # no lock file while it ran: nothing else was written
    with pytest.raises(AttributeError):
        jn.RunFolderInUse  # noqa: B018 - the plugin's export goes with it


class _NoRelease:
    @jn.hookimpl
    def jaxnitro_hold_run_folder(self, folder, dist):
        return "held"


def test_a_hold_without_release_is_refused_naming_the_hook(tmp_path):
    with run_scoped([_NoRelease()]):
        n = jn.Nitro(Tiny(max_epochs=1), data=tiny_data(), run_dir=tmp_path, logger=None)
        with pytest.raises(TypeError) as err:
            n.train()
    assert str(err.value) == (
        "jaxnitro: the `jaxnitro_hold_run_folder` hook answered 'held', which has no `release(status)` "
        "method. The plugin that answers it must return a hold the core can release at the run's end (see "
        "jaxnitro.plugin.RunFolderHold), or None."
    )
    assert n.status == "failed" and os.listdir(n.run_dir) == []


# -- the persistent compilation cache ----------------------------------------------------------

_CACHE_OPTIONS = ("jax_enable_compilation_cache", "jax_compilation_cache_dir",
                  "jax_persistent_cache_min_compile_time_secs", "jax_persistent_cache_min_entry_size_bytes")


@pytest.fixture
def jax_cache_config():
    """Put JAX's persistent-cache options back as they were (the switch is process-wide)."""
    from jax.experimental.compilation_cache import compilation_cache as cc

    before = {name: getattr(jax.config, name) for name in _CACHE_OPTIONS}
    yield
    for name, value in before.items():
        jax.config.update(name, value)
    cc.reset_cache()


def test_the_compilation_cache_knob_switches_the_cache_on_through_its_plugin(tmp_path, jax_cache_config):
    folder = tmp_path / "xla"
    n = jn.Nitro(Tiny(), data=tiny_data(), logger=None, compilation_cache=str(folder))
    assert jax.config.jax_compilation_cache_dir == str(folder) and folder.is_dir()
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
    assert P.owns_knob(n, "compilation_cache", "jaxnitro.plugins.compilation_cache")
    again = tmp_path / "again"
    assert jn.enable_persistent_cache(again) == str(again)  # the function asks the same plugin
    assert jax.config.jax_compilation_cache_dir == str(again)


def test_a_compilation_cache_value_that_is_no_folder_is_refused(jax_cache_config):
    with pytest.raises(ValueError) as err:
        jn.Nitro(Tiny(), data=tiny_data(), logger=None, compilation_cache=3)
    assert str(err.value) == (
        "jaxnitro: run knob `compilation_cache` = 3 (keyword) is not a folder: pass the folder for JAX's "
        "persistent compilation cache (`compilation_cache=\"~/.cache/jaxnitro/xla\"`), True for the default "
        "folder, or None to leave the cache off."
    )


def test_without_the_cache_plugin_the_switch_and_the_knob_say_so(disabled, jax_cache_config):
    disabled("compilation_cache")
    with pytest.raises(RuntimeError, match=r"no plugin switches a persistent compilation cache on \(hook "
                                           r"`jaxnitro_persistent_cache`\) \(plugins disabled by "
                                           r"JAXNITRO_DISABLE_PLUGINS: compilation_cache\)"):
        jn.enable_persistent_cache()
    with pytest.raises(ValueError, match="run knob `compilation_cache` is set .* but no loaded plugin acts on it"):
        jn.Nitro(Tiny(), data=tiny_data(), logger=None, compilation_cache=True)


# -- the logger relay ----------------------------------------------------------------------------


class _FailsOnce:
    """A logger whose first ``log_metrics`` call raises; it records every verb it gets."""

    def __init__(self):
        self.calls, self.failed = [], False

    def log_params(self, params):
        self.calls.append("params")

    def log_other(self, key, value):
        self.calls.append(key)

    def log_metrics(self, metrics, *, step, epoch, context):
        if not self.failed:
            self.failed = True
            raise RuntimeError("refused")
        self.calls.append(context)

    def finish(self, status):
        self.calls.append(f"finish:{status}")


def test_a_logger_that_failed_in_one_run_is_driven_again_in_the_next(tmp_path):
    """The relay's state (which logger failed) belongs to one run (``run.store``), not the process."""
    logger = _FailsOnce()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = jn.train(Tiny(max_epochs=1), data={"train": tiny_data()["train"]}, run_dir=tmp_path, logger=logger)
    assert logger.calls == ["params", "binding_report"]  # nothing more after its failure, not even finish
    assert any("failed in `log_metrics`: RuntimeError: refused" in str(w.message) for w in caught)
    assert first.status == "done"
    logger.calls.clear()
    jn.train(Tiny(max_epochs=1), data={"train": tiny_data()["train"]}, run_dir=tmp_path, logger=logger)
    assert logger.calls[:2] == ["params", "binding_report"] and logger.calls[-1] == "finish:done"
    assert logger.calls.count("train") == 6  # one line per step of the epoch
