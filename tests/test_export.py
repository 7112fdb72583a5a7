"""``nitro.export(path)`` / ``jn.load_exported(path)``: the inference program with ``jax.export``,
bitwise equal to ``nitro.predict``; the refusals; Device values baked or as inputs; the metadata;
and serving from a data-less handle (no optimizer state)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxnitro as jn
from jaxnitro.plugins.export import METADATA_FILE, PROGRAM_FILE, ExportError

from tiny import Tiny, fresh_tiny, tiny_data

DATA = tiny_data()
X = np.concatenate([b["x"] for b in DATA["val"]])  # 40 rows


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A trained Tiny with a non-trivial Device value (temperature 0.7, baked in)."""
    run_dir = tmp_path_factory.mktemp("runs")
    return jn.Nitro(Tiny(temperature=0.7), data=DATA, run_dir=run_dir, logger=None).train()


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    path = tmp_path_factory.mktemp("export") / "tiny"
    return trained.export(path)


def test_roundtrip_is_bitwise_equal_to_predict(trained, exported):
    f = jn.load_exported(exported)
    for k in (16, 5, 1):  # the compiled width, and narrower batches (padded as predict pads them)
        want = trained.predict({"x": X[:k]})
        got = f(x=X[:k])
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == (k, 4)
        np.testing.assert_array_equal(got, want)
    # the batch dimension is symbolic: a wider batch runs at its own size (predict refuses it)
    wide = f(x=X)
    assert wide.shape == (40, 4)
    np.testing.assert_allclose(wide[:16], trained.predict({"x": X[:16]}), rtol=1e-5, atol=1e-6)
    # extra fields are ignored, as predict ignores them
    np.testing.assert_array_equal(f(x=X[:3], label=np.zeros((3, 4), np.float32)), trained.predict({"x": X[:3]}))


def test_metadata(trained, exported):
    assert sorted(os.listdir(exported)) == sorted([METADATA_FILE, PROGRAM_FILE])
    with open(os.path.join(exported, METADATA_FILE)) as fh:
        meta = json.load(fh)
    assert meta["format"] == "jaxnitro-export/1"
    assert meta["experiment"] == {"class": "tiny.Tiny", "graph_const": {"width": 16}}
    assert meta["jax_version"] == jax.__version__
    assert meta["inputs"] == {"x": {"shape": ["batch", 8], "dtype": "float32", "required": True}}
    assert meta["batch"]["symbolic"] is True and meta["batch"]["width"] == 16
    assert meta["outputs"]["leaves"] == [{"path": "", "shape": ["batch", 4], "dtype": "float32"}]
    assert meta["device"]["mode"] == "baked"
    assert meta["device"]["values"]["temperature"] == {"value": pytest.approx(0.7), "shape": [], "dtype": "float32"}
    assert meta["weights"]["mode"] == "baked" and meta["weights"]["source"] == "params"
    assert meta["weights"]["parameters"] == 8 * 16 + 16 + 16 * 4 + 4
    assert "metrics" in meta["not_included"] and "not part of the exported program" in meta["not_included"]["metrics"]
    assert meta["platforms"] == [jax.default_backend()]
    f = jn.load_exported(exported)
    assert f.metadata == meta and "tiny.Tiny" in repr(f)


def test_loaded_callable_checks_its_inputs(exported):
    f = jn.load_exported(exported)
    with pytest.raises(TypeError, match=r"needs field\(s\) \['x'\]"):
        f(label=X[:2])
    with pytest.raises(TypeError, match="astype"):
        f(x=X[:2].astype(np.float64))
    with pytest.raises(ValueError, match="batch dimension first"):
        f(x=X[0])


def test_device_values_baked_or_inputs(tmp_path):
    n = jn.Nitro(Tiny(temperature=0.5), data=DATA, logger=None)
    baked = jn.load_exported(n.export(tmp_path / "baked"))
    as_inputs = jn.load_exported(n.export(tmp_path / "inputs", device_inputs=True))
    assert as_inputs.metadata["device"]["mode"] == "inputs"
    before = n.predict({"x": X[:16]})
    np.testing.assert_array_equal(baked(x=X[:16]), before)
    np.testing.assert_array_equal(as_inputs(x=X[:16]), before)  # a missing Device value takes its exported value
    n.set_device(temperature=2.0)
    after = n.predict({"x": X[:16]})
    assert not np.array_equal(before, after)
    np.testing.assert_array_equal(as_inputs(x=X[:16], temperature=2.0), after)
    np.testing.assert_array_equal(baked(x=X[:16]), before)  # baked: set_device after export changes nothing
    # baked: a Device value passed per call cannot be applied, so it is refused, not ignored
    with pytest.raises(TypeError, match=r"(?s)Device value\(s\) \['temperature'\] passed to an export that "
                       r"baked them in \(temperature=0.5.*device_inputs=True"):
        baked(x=X[:16], temperature=100.0)


def test_ema_weights_are_exported(tmp_path):
    n = jn.Nitro(Tiny(), data=DATA, run_dir=tmp_path, logger=None, ema=jn.EMA(decay=0.5)).train()
    f = jn.load_exported(n.export(tmp_path / "ema"))
    assert f.metadata["weights"]["source"] == "ema"
    np.testing.assert_array_equal(f(x=X[:7]), n.predict({"x": X[:7]}))
    assert not np.array_equal(f(x=X[:7]), np.asarray(jax.vmap(eqx_combine(n.params, n))(X[:7])))


def eqx_combine(params, n):
    import equinox as eqx

    return eqx.combine(params, n.plan.skeleton.static)


def test_refuses_unknown_shapes_then_example_or_predict(tmp_path):
    bare = jn.Nitro(Tiny(), data={})
    with pytest.raises(ExportError, match=r"(?s)unknown.*no data.*example=.*nitro.predict\(batch\)"):
        bare.export(tmp_path / "a")
    assert not (tmp_path / "a").exists()
    f = jn.load_exported(bare.export(tmp_path / "b", example={"x": X[:10]}))
    assert f.metadata["batch"]["width"] == 10 and bare.plan.width == 10  # example= acts as the first predict
    np.testing.assert_array_equal(f(x=X[:4]), bare.predict({"x": X[:4]}))
    other = jn.Nitro(Tiny(), data={})
    other.predict({"x": X[:8]})
    g = jn.load_exported(other.export(tmp_path / "c"))
    assert g.metadata["batch"]["width"] == 8
    np.testing.assert_array_equal(g(x=X[:8]), other.predict({"x": X[:8]}))


def test_refuses_host_callbacks(tmp_path):
    def forward(self, model, state, *, x):
        jax.debug.callback(lambda v: None, x)
        return jax.vmap(model)(x), state

    def forward_pure(self, model, state, *, x):
        y = jax.pure_callback(lambda v: np.asarray(v), jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        return jax.vmap(model)(y), state

    for fwd in (forward, forward_pure):
        n = jn.Nitro(fresh_tiny(forward=fwd)(), data=DATA, logger=None)
        with pytest.raises(ExportError, match=r"(?s)calls back into Python.*callback.*Fix"):
            n.export(tmp_path / fwd.__name__)


def test_concrete_batch_when_the_model_needs_it(tmp_path):
    def forward(self, model, state, *, x):
        rows = jnp.asarray(np.arange(x.shape[0], dtype=np.float32))  # NumPy needs a concrete size
        return jax.vmap(model)(x) + rows[:, None], state

    n = jn.Nitro(fresh_tiny(forward=forward)(), data=DATA, logger=None)
    f = jn.load_exported(n.export(tmp_path / "concrete"))
    meta = f.metadata
    assert meta["batch"]["symbolic"] is False and meta["batch"]["why_not_symbolic"]
    assert meta["inputs"]["x"]["shape"] == [16, 8]
    np.testing.assert_array_equal(f(x=X[:5]), n.predict({"x": X[:5]}))
    with pytest.raises(ValueError, match="wider than the exported width 16"):
        f(x=X)


def test_structured_outputs(tmp_path):
    def forward(self, model, state, *, x):
        logits = jax.vmap(model)(x)
        return {"logits": logits, "probs": (jax.nn.softmax(logits), logits.argmax(-1))}, state

    n = jn.Nitro(fresh_tiny(forward=forward)(), data=DATA, logger=None)
    f = jn.load_exported(n.export(tmp_path / "tree"))
    got, want = f(x=X[:3]), n.predict({"x": X[:3]})
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    jax.tree_util.tree_map(np.testing.assert_array_equal, got, want)
    paths = [leaf["path"] for leaf in f.metadata["outputs"]["leaves"]]
    assert paths == ["['logits']", "['probs'][0]", "['probs'][1]"]


def test_serving_handle_allocates_no_optimizer_state():
    def new_bytes(build):
        before = {id(a) for a in jax.live_arrays()}
        handle = build()
        new = [a for a in jax.live_arrays() if id(a) not in before]
        return handle, sum(a.nbytes for a in new)

    serving, serving_bytes = new_bytes(lambda: jn.Nitro(Tiny(), data={}))
    training, training_bytes = new_bytes(lambda: jn.Nitro(Tiny(), data=DATA, logger=None))
    assert serving.opt_state is None and serving.plan.opt_spec is None and serving.plan.tx is None
    assert training.opt_state is not None
    p_bytes = sum(a.nbytes for a in jax.tree_util.tree_leaves(serving.params))
    # params, the run key and the Device values; nothing sized like the optimizer's moments
    assert serving_bytes <= p_bytes + 256
    opt_bytes = sum(a.nbytes for a in jax.tree_util.tree_leaves(training.opt_state))
    assert opt_bytes >= 2 * p_bytes and training_bytes >= serving_bytes + 2 * p_bytes
    # routing and width come from the first predicted batch
    assert serving.plan.width is None
    out = serving.predict({"x": X[:12], "label": np.zeros((12, 4), np.float32)})
    assert out.shape == (12, 4) and serving.plan.width == 12
    assert serving.opt_state is None


@pytest.mark.slow
def test_fresh_process_loads_without_the_experiment(trained, exported, tmp_path):
    expected = {"x16": X[:16], "x5": X[:5], "y16": trained.predict({"x": X[:16]}), "y5": trained.predict({"x": X[:5]})}
    np.savez(tmp_path / "expected.npz", **expected)
    script = textwrap.dedent(
        f"""
        import sys
        import numpy as np
        import jaxnitro as jn
        f = jn.load_exported({os.fspath(exported)!r})
        e = np.load({os.fspath(tmp_path / "expected.npz")!r})
        np.testing.assert_array_equal(f(x=e["x16"]), e["y16"])
        np.testing.assert_array_equal(f(x=e["x5"]), e["y5"])
        assert "tiny" not in sys.modules, "the experiment's module was imported"
        assert f.metadata["experiment"]["class"] == "tiny.Tiny"
        print("OK")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().endswith("OK")


# -- nothing silent: the destination, a damaged artifact, a conv net bitwise ---------------------


def counting_tiny():
    """A fresh Tiny whose ``forward`` counts its traces (in ``traces``)."""
    traces = []

    def forward(self, model, state, *, x):
        traces.append(x.shape)
        return jax.vmap(model)(x) / self.temperature, state

    return fresh_tiny("Counting", forward=forward), traces


def test_the_destination_is_checked_before_tracing(tmp_path):
    cls, traces = counting_tiny()
    n = jn.Nitro(cls(), data=DATA, logger=None)
    before = len(traces)
    a_file = tmp_path / "a_file"
    a_file.write_text("not an export")
    cases = [
        (a_file, r"cannot export to .*a_file: it is an existing file.*Fix: pass a folder path"),
        (a_file / "below", r"cannot export to .*below: .*a_file is a file.*Fix: choose a path whose parents are folders"),
    ]
    for path, message in cases:
        with pytest.raises(ExportError, match=message):
            n.export(path)
    assert len(traces) == before, "the refusal came after tracing forward"
    assert a_file.read_text() == "not an export"

    first = n.export(tmp_path / "twice")
    before = len(traces)
    with pytest.raises(ExportError, match=r"(?s)cannot export to .*twice: the folder already holds an export "
                       r"\(forward.jaxexport, metadata.json\).*overwrite=True"):
        n.export(tmp_path / "twice")
    assert len(traces) == before
    n.set_device(temperature=3.0)
    jn.load_exported(n.export(first, overwrite=True))  # replaced: the new Device value is baked
    assert jn.load_exported(first).metadata["device"]["values"]["temperature"]["value"] == 3.0
    assert sorted(os.listdir(first)) == sorted([METADATA_FILE, PROGRAM_FILE])  # no .partial left


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to a read-only folder")
def test_an_unwritable_destination_is_refused_before_tracing(tmp_path):
    cls, traces = counting_tiny()
    n = jn.Nitro(cls(), data=DATA, logger=None)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    before = len(traces)
    try:
        with pytest.raises(ExportError, match=r"(?s)cannot export to .*locked/e: the folder .*locked cannot be written.*Fix"):
            n.export(locked / "e")
    finally:
        locked.chmod(0o700)
    assert len(traces) == before


def damaged_copies(src, tmp_path):
    """``{name: folder}``: copies of the export ``src``, each damaged one way."""
    import shutil

    program = (src / PROGRAM_FILE).read_bytes()
    meta = (src / METADATA_FILE).read_text()
    mid = len(program) // 2
    damage = {
        "truncated_program": {PROGRAM_FILE: program[:mid]},
        "flipped_byte": {PROGRAM_FILE: program[:mid] + bytes([program[mid] ^ 0xFF]) + program[mid + 1 :]},
        "empty_program": {PROGRAM_FILE: b""},
        "truncated_metadata": {METADATA_FILE: meta[: len(meta) // 2].encode()},
        "missing_program": {PROGRAM_FILE: None},
        "missing_metadata": {METADATA_FILE: None},
    }
    out = {}
    for name, files in damage.items():
        dst = tmp_path / name
        shutil.copytree(src, dst)
        for file, data in files.items():
            (dst / file).unlink() if data is None else (dst / file).write_bytes(data)
        out[name] = dst
    return out


def test_a_damaged_export_is_one_error_naming_the_file(exported, tmp_path):
    from pathlib import Path

    copies = damaged_copies(Path(exported), tmp_path)
    expect = {
        "truncated_program": (PROGRAM_FILE, "is not the file that was exported"),
        "flipped_byte": (PROGRAM_FILE, "is not the file that was exported"),
        "empty_program": (PROGRAM_FILE, "is not the file that was exported"),
        "truncated_metadata": (METADATA_FILE, "cannot be read as JSON"),
        "missing_program": (PROGRAM_FILE, "is missing"),
        "missing_metadata": (METADATA_FILE, "is missing"),
    }
    for name, folder in copies.items():
        file, what = expect[name]
        with pytest.raises(ExportError) as info:
            jn.load_exported(folder)
        msg = str(info.value)
        assert f"{folder / file} {what}" in msg and "export it again" in msg and "overwrite=True" in msg, (name, msg)
    with pytest.raises(ExportError, match=r"cannot load the export at .*nowhere: no such folder"):
        jn.load_exported(tmp_path / "nowhere")
    with pytest.raises(ExportError, match=r"cannot load the export at .*metadata.json: it is a file"):
        jn.load_exported(Path(exported) / METADATA_FILE)


def test_a_program_that_fails_to_deserialize_at_the_call_names_the_file(exported, tmp_path):
    """Damage the checksum cannot see (metadata.json rewritten to match): XLA's "Failed to
    deserialize StableHLO" at the first call becomes an ExportError naming the file."""
    import hashlib
    from pathlib import Path

    folder = damaged_copies(Path(exported), tmp_path)["flipped_byte"]
    blob = (Path(exported) / PROGRAM_FILE).read_bytes()
    # a quarter of the program overwritten: one flipped byte can land in a source location's
    # text (file paths, line numbers: they move with the checkout and the code), which XLA reads
    quarter = len(blob) // 4
    blob = blob[:quarter] + b"\xff" * quarter + blob[2 * quarter:]
    (folder / PROGRAM_FILE).write_bytes(blob)
    meta = json.loads((folder / METADATA_FILE).read_text())
    meta["program"] = {"file": PROGRAM_FILE, "bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    (folder / METADATA_FILE).write_text(json.dumps(meta))
    try:
        f = jn.load_exported(folder)
    except ExportError as err:  # flatbuffers saw it at load: named there
        assert f"{folder / PROGRAM_FILE} does not deserialize" in str(err)
        return
    with pytest.raises(ExportError, match=r"(?s)cannot run: XLA failed to deserialize the StableHLO program in "
                       r".*forward.jaxexport.*export it again"):
        f(x=X[:3])


class ConvNet(__import__("equinox").Module):
    conv: object
    head: object

    def __init__(self, key):
        import equinox as eqx

        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(1, 4, 3, key=k1)
        self.head = eqx.nn.Linear(4 * 6 * 6, 4, key=k2)

    def __call__(self, x):
        return self.head(jax.nn.relu(self.conv(x)).reshape(-1))


def test_a_conv_net_export_is_bitwise_equal_to_predict(tmp_path):
    """XLA folds constant (baked) weights into a convolution and rounds differently from
    predict's program, which takes them as inputs (measured 1.2e-7 here); the export's
    optimization barrier keeps them opaque, so the two agree bit for bit."""
    images = np.random.default_rng(0).normal(size=(16, 1, 8, 8)).astype(np.float32)

    def build_model(self, key):
        return ConvNet(key)

    def forward(self, model, state, *, x):
        return jax.vmap(model)(x) / self.temperature, state

    n = jn.Nitro(fresh_tiny("TinyConv", build_model=build_model, forward=forward)(temperature=0.7),
                 data={}, logger=None)
    want = n.predict({"x": images})
    for symbolic in (True, False):
        f = jn.load_exported(n.export(tmp_path / f"conv-{symbolic}", symbolic_batch=symbolic))
        for k in (16, 5):
            np.testing.assert_array_equal(f(x=images[:k]), n.predict({"x": images[:k]}))
        np.testing.assert_array_equal(f(x=images), want)
