"""The ``jaxnitro`` command line (entry point ``cli``), on jsonargparse.

``jaxnitro train pkg.module:Class --width 256 --max_epochs 3 --logger tensorboard
--config run.yaml``, ``jaxnitro evaluate``, ``jaxnitro predict``, ``jaxnitro runs
RUN_DIR``; ``python -m jaxnitro`` is the same (``jaxnitro/__main__.py`` finds this
module through its entry point, so the core imports no plugin folder). docs/cli.md
is the guide.

* :mod:`.arguments`: an experiment class as options (fields with marker, type,
  default and docstring; the run knobs of ``jaxnitro.knobs.RUN_KNOBS``) and the YAML
  that reproduces a command (``--print_config`` / ``--config``);
* :mod:`.interrupt`: Ctrl-C and a preemption (SIGTERM, ``max_time``) print the command
  that continues the run; exit 130 and 143;
* :mod:`.runs_table`: the table of ``jaxnitro runs``;
* :mod:`.commands`: the commands and :func:`main`.

A script can build its own command line on the same machinery (the MNIST tutorial
does): :func:`build_parser`, :func:`parse`, :func:`train_options`,
:func:`on_interrupt`, :func:`program_words`.
"""

from __future__ import annotations

from .arguments import CommandLineError, Invocation, build_parser, config_yaml, load_class, parse
from .commands import main, run_train, train_options, weights_spec
from .interrupt import continue_command, interrupt_line, on_interrupt, program_words
from .runs_table import format_runs, read_run, read_runs

__all__ = [
    "CommandLineError", "Invocation", "build_parser", "config_yaml", "continue_command", "format_runs",
    "interrupt_line", "load_class", "main", "on_interrupt", "parse", "program_words", "read_run",
    "read_runs", "run_train", "train_options", "weights_spec",
]
