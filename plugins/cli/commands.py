"""The ``jaxnitro`` commands: ``train``, ``evaluate``, ``predict``, ``runs``.

``main(argv)`` is the console script (``jaxnitro ...``) and ``python -m jaxnitro``;
it returns the exit status: 0, 1 for a run that ended other than ``done``, 2 for a
refused command line or a refusal of jaxnitro's (the message printed, no traceback,
each knob the command line set named as its option: `--max_steps 0`), 130 after Ctrl-C,
143 for a run preempted by SIGTERM or its ``max_time`` (requeue it and run it again with
``--resume``); after Ctrl-C and a preemption one line on stderr says how to continue.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path

import numpy as np

from jaxnitro.plugin import RUN_KNOBS

from .arguments import CommandLineError, build_parser, config_yaml, load_class, parse
from .interrupt import on_interrupt, position, program_words
from .runs_table import format_runs, read_runs

__all__ = ["main", "train_options", "weights_spec", "run_train", "COMMANDS"]

COMMANDS = {
    "train": "train an experiment class: jaxnitro train pkg.module:Class [--field value] [--knob value] [--config run.yaml]",
    "evaluate": "evaluate a checkpoint on a split: jaxnitro evaluate CLASS --weights RUN[:best|:last|:STEP] [--split test]",
    "predict": "run forward on a .npz of batch fields: jaxnitro predict CLASS --weights W --input batch.npz [--output out.npz]",
    "runs": "a table of the runs in a folder: jaxnitro runs RUN_DIR",
}

CONFIG_NAME = "config.yaml"
"""What ``jaxnitro train`` writes into the run folder: the YAML that reproduces the run."""


def _overview(prog: str) -> str:
    width = max(map(len, COMMANDS))
    lines = [f"usage: {prog} {{{','.join(COMMANDS)}}} ...", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {text}" for name, text in COMMANDS.items()]
    lines += ["", f"`{prog} COMMAND CLASS --help` lists the class's fields (marker, type, default, doc) and the run knobs."]
    return "\n".join(lines)


# -- options of the commands ----------------------------------------------------------------------


def train_options(parser) -> list[str]:
    """``--resume`` and ``--weights``: the options of ``train`` (and of the tutorial script)."""
    parser.add_argument("--resume", action="store_true",
                        help="continue the newest run in run_dir from its newest checkpoint (after Ctrl-C, "
                             "a kill or a crash): jn.Nitro(e, resume='auto')")
    parser.add_argument("--weights", type=str, default=None,
                        help="start from these weights with a fresh optimizer: a run folder or checkpoint "
                             "path, RUN:best, RUN:last, RUN:STEP, latest, latest:best")
    return ["resume", "weights"]


def _evaluate_options(parser) -> list[str]:
    parser.add_argument("--weights", type=str, required=True,
                        help="the checkpoint: a run folder (its last checkpoint), a checkpoint folder, "
                             "RUN:best, RUN:last, RUN:STEP, latest, latest:best")
    parser.add_argument("--split", type=str, default="test", help="the split to evaluate")
    parser.add_argument("--output", type=str, default=None, help="also write the metrics to this JSON file")
    return ["weights", "split", "output"]


def _predict_options(parser) -> list[str]:
    parser.add_argument("--weights", type=str, required=True,
                        help="the checkpoint (as for evaluate): RUN, RUN:best, a checkpoint folder, latest:best")
    parser.add_argument("--input", type=str, required=True,
                        help="a .npz whose arrays are the batch fields `forward` declares (rows first)")
    parser.add_argument("--output", type=str, default="predictions.npz",
                        help="where to write the outputs (.npz; a dict or tuple of outputs becomes one array per leaf)")
    return ["weights", "input", "output"]


_OPTIONS = {"train": train_options, "evaluate": _evaluate_options, "predict": _predict_options}


def weights_spec(text: str | None):
    """A ``--weights`` / checkpoint string as ``jn.Nitro``'s ``weights=``: ``RUN:best`` ->
    ``("RUN", "best")``, ``RUN:123`` -> ``("RUN", 123)``, anything else as given (a path,
    ``latest``)."""
    if text is None:
        return None
    head, sep, tail = text.rpartition(":")
    if sep and head:
        if tail in ("best", "last"):
            return (head, tail)
        if tail.isdigit():
            return (head, int(tail))
    return text


# -- the class named on the command line -----------------------------------------------------------


def _class_and_rest(command: str, rest: list[str]) -> tuple[str | None, list[str]]:
    """``(class spec, remaining args)``: the first argument, or the ``experiment`` key of a
    ``--config`` file when the first argument is an option."""
    if rest and not rest[0].startswith("-"):
        return rest[0], rest[1:]
    spec = None
    for i, arg in enumerate(rest):
        path = rest[i + 1] if arg == "--config" and i + 1 < len(rest) else (
            arg.split("=", 1)[1] if arg.startswith("--config=") else None)
        if path is None:
            continue
        import yaml

        try:
            with open(path, encoding="utf-8") as f:
                data = yaml.safe_load(f) or {}
        except OSError as err:
            raise CommandLineError(f"--config {path}: {err.strerror}") from None
        if isinstance(data, dict) and data.get("experiment"):
            spec = str(data["experiment"])
    return spec, rest


def _jaxnitro_refusal(err: BaseException) -> bool:
    return str(err).startswith(("jaxnitro", "jn.")) or "jaxnitro:" in str(err)[:40]


def _message(err: BaseException) -> str:
    """``err``'s message as written: a ``KeyError`` of one string without the quotes ``str()``
    puts around it."""
    if isinstance(err, KeyError) and len(err.args) == 1 and isinstance(err.args[0], str):
        return err.args[0]
    return str(err)


_KEYWORD_KNOB = re.compile(r"`(\w+)` = (.*?) \(keyword\)")
"""How the core names a knob passed to ``jn.Nitro`` as a keyword: ```max_steps` = 0 (keyword)``."""


def _option_value(argv: list[str], option: str) -> str | None:
    """The value the last ``option VALUE`` / ``option=VALUE`` in ``argv`` gives, as typed; None
    when ``argv`` does not give the option."""
    value = None
    for i, word in enumerate(argv):
        if word == option and i + 1 < len(argv):
            value = argv[i + 1]
        elif word.startswith(option + "="):
            value = word.split("=", 1)[1]
    return value


def _as_options(text: str, argv: list[str]) -> str:
    """``text`` with each knob the core names as a keyword (```max_steps` = 0 (keyword)``)
    named as the command line spelled it: ```--max_steps 0` ``, or, for a knob a ``--config``
    file set, ```max_steps` = 0 (--config run.yaml)``."""
    config = _option_value(argv, "--config")

    def spell(m: re.Match) -> str:
        name = m.group(1)
        if name not in RUN_KNOBS:  # not an option of the command line: leave the core's words
            return m.group(0)
        typed = _option_value(argv, f"--{name}")
        if typed is not None:
            return f"`{shlex.join([f'--{name}', typed])}`"
        where = f"--config {config}" if config is not None else "command line"
        return f"`{name}` = {m.group(2)} ({where})"

    return _KEYWORD_KNOB.sub(spell, text)


# -- the commands ------------------------------------------------------------------------------------


def run_train(inv, prog_words: list[str], argv: list[str], *, quiet: bool = False):
    """Train what ``inv`` describes (Ctrl-C: :func:`on_interrupt`); write the run's YAML into its
    folder; return the handle."""
    import jaxnitro as jn

    kwargs = dict(inv.knobs)
    if inv.options.get("resume"):
        kwargs["resume"] = "auto"
    if inv.options.get("weights"):
        kwargs["weights"] = weights_spec(inv.options["weights"])
    ref: list = []
    with on_interrupt(prog_words, argv, ref):
        nitro = jn.Nitro(inv.experiment, **kwargs)
        ref[:] = [nitro]
        if not quiet:
            print(nitro)
        try:
            nitro.train()
        finally:
            if nitro.run_dir is not None:
                Path(nitro.run_dir, CONFIG_NAME).write_text(config_yaml(inv), encoding="utf-8")
    return nitro


def _train(inv, prog_words, argv) -> int:
    nitro = run_train(inv, prog_words, argv)
    monitor = nitro.settings.monitor
    best = nitro.history().best if monitor and len(nitro.history()) else None
    print(f"{nitro.status}: {position(nitro, done=True)}"
          + (f"; {nitro.stop_reason}" if nitro.stop_reason else ""))
    if best is not None:
        where = f"step {best['step']:,} (epoch {best['epoch']})" if nitro.settings.val_every_n_steps else f"epoch {best['epoch']}"
        print(f"best: {where}, {monitor[0]} {best[monitor[0]]:.4g}")
    print(f"run: {nitro.run_dir} (metrics.jsonl, {CONFIG_NAME}"
          + (", checkpoints/)" if nitro.settings.checkpointer is not None else ")"))
    return 0 if nitro.status == "done" else 1


def _scalars(metrics: dict) -> tuple[dict, dict]:
    scalars, others = {}, {}
    for k, v in metrics.items():
        if np.ndim(v) == 0 and isinstance(np.asarray(v).item(), (int, float)):
            scalars[k] = float(np.asarray(v).item())
        else:
            others[k] = np.asarray(v)
    return scalars, others


def _evaluate(inv, prog_words, argv) -> int:
    import jaxnitro as jn

    o = inv.options
    with on_interrupt(prog_words, argv, [], training=False):
        nitro = jn.Nitro(inv.experiment, weights=weights_spec(o["weights"]), **inv.knobs)
        metrics = nitro.evaluate(split=o["split"])
    scalars, others = _scalars(metrics)
    meta = getattr(nitro.plan, "weights_meta", None) or {}
    where = f" (checkpoint of step {meta['step']:,}, epoch {meta['epoch']})" if "step" in meta else ""
    print(f"{o['split']} of {o['weights']}{where}: " + "  ".join(f"{k} {v:.4f}" for k, v in scalars.items()))
    for k, v in others.items():
        print(f"  {k}: array {v.shape} {v.dtype}")
    if o.get("output"):
        record = {"split": o["split"], "weights": o["weights"], **scalars, **{k: v.tolist() for k, v in others.items()}}
        Path(o["output"]).write_text(json.dumps(record, indent=1), encoding="utf-8")
        print(f"wrote {o['output']}")
    return 0


def _flat_outputs(outputs) -> dict[str, np.ndarray]:
    import jax

    if not isinstance(outputs, (dict, list, tuple)):
        return {"outputs": np.asarray(outputs)}
    leaves = jax.tree_util.tree_flatten_with_path(outputs)[0]
    return {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): np.asarray(v) for path, v in leaves}


def _predict(inv, prog_words, argv) -> int:
    import jaxnitro as jn

    o = inv.options
    try:
        with np.load(o["input"], allow_pickle=False) as f:
            batch = {k: f[k] for k in f.files}
    except (OSError, ValueError) as err:
        raise CommandLineError(f"--input {o['input']}: not a readable .npz ({err})") from None
    with on_interrupt(prog_words, argv, [], training=False):
        nitro = jn.Nitro(inv.experiment, data={}, weights=weights_spec(o["weights"]), **inv.knobs)
        outputs = nitro.predict(batch)
    flat = _flat_outputs(outputs)
    np.savez(o["output"], **flat)
    rows = next(iter(batch.values())).shape[0] if batch else 0
    print(f"predicted {rows} rows of {o['input']}; wrote {o['output']}: "
          + ", ".join(f"{k} {v.shape} {v.dtype}" for k, v in flat.items()))
    return 0


def _runs(argv: list[str], prog: str) -> int:
    parser = argparse.ArgumentParser(prog=f"{prog} runs", description=COMMANDS["runs"])
    parser.add_argument("run_dir", help="the run_dir knob's folder: one sub-folder per run")
    args = parser.parse_args(argv)
    print(format_runs(read_runs(args.run_dir), args.run_dir))
    return 0


_RUN = {"train": _train, "evaluate": _evaluate, "predict": _predict}


def main(argv: list[str] | None = None, *, prog_words: list[str] | None = None) -> int:
    """Run ``jaxnitro ARGV``; return the exit status (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prog_words = program_words() if prog_words is None else list(prog_words)
    prog = " ".join(prog_words)
    if not argv or argv[0] in ("-h", "--help"):
        print(_overview(prog))
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    try:
        if command == "runs":
            return _runs(rest, prog)
        if command not in _RUN:
            raise CommandLineError(f"unknown command {command!r}; the commands: {', '.join(COMMANDS)}.")
        spec_text, rest = _class_and_rest(command, rest)
        if spec_text is None:
            if any(a in ("-h", "--help") for a in rest):
                print(f"usage: {prog} {command} pkg.module:Class [options]\n\n{COMMANDS[command]}\n\n"
                      f"Name the class to see its options: {prog} {command} pkg.module:Class --help")
                return 0
            raise CommandLineError(
                f"name the experiment class: `{prog} {command} pkg.module:Class ...` (or "
                f"path/to/file.py:Class), or give a --config file with an `experiment:` key."
            )
        cls = load_class(spec_text)
        spec = build_parser(cls, prog=f"{prog} {command} {spec_text}", command_options=_OPTIONS[command],
                            with_experiment=True)
        inv = parse(spec, rest, experiment_spec=spec_text)
        if inv.print_config:
            sys.stdout.write(config_yaml(inv))
            return 0
        return _RUN[command](inv, prog_words, argv)
    except CommandLineError as err:
        print(f"{prog} {command}: error: {err}", file=sys.stderr)
        return 2
    except (TypeError, ValueError, KeyError, FileNotFoundError) as err:
        if not _jaxnitro_refusal(err) and not isinstance(err, FileNotFoundError):
            raise
        print(f"{prog} {command}: error: {_as_options(_message(err), argv)}", file=sys.stderr)
        return 2
    except SystemExit as exit_:  # --help (0), argparse's own usage errors (2), Ctrl-C (130), preempted (143)
        return exit_.code if isinstance(exit_.code, int) else 1
    finally:
        sys.stdout.flush()
