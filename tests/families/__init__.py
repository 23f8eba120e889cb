"""Each declared family's test fixtures, keyed by the family's name: ``tests/families/<name>.py`` holds

* ``tiny(config, images)``: the overrides that shrink any of the family's configs to seconds on a CPU (``images``:
  a folder of fake on-disk images, for data sets not stored offline); a family's tiny run caps its epoch length
  (the resume test trains two epochs);
* ``phantom_probe(deq)`` (required of a family with a ``deq`` config): a DEQ factory -> a tiny float64 model of the
  family built with it and its loss as a closure (``tests/deq/test_family_phantom.py``);
* ``STUDY_TINY`` (a family in the study): the study test's (study options, fit options).

The family itself is declared in :mod:`deqscore.families`; a fixture file names no family the declarations lack.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from deqscore.families import declarations

# option pieces the fixtures share
NET = "--model.init_args.net.init_args"
MNIST_WORKERS = ["--data.init_args.num_workers", "0"]
MNIST_SUBSETS = ["--data.init_args.train_subset", "48", "--data.init_args.val_subset", "16",
                 "--data.init_args.test_subset", "16"]
TINY_MNIST = ["--data.init_args.train_subset", "32", "--data.init_args.val_subset", "16",
              "--data.init_args.test_subset", "16", "--data.init_args.batch_size", "8",
              "--data.init_args.eval_batch_size", "8", *MNIST_WORKERS]
#: the study test's MNIST subsets, as KEY=VALUE (the study passes them on in one list)
STUDY_MNIST = ("--data.init_args.train_subset=48", "--data.init_args.val_subset=16",
               "--data.init_args.test_subset=16", "--data.init_args.eval_batch_size=16")


def fixture_file(name: str) -> ModuleType:
    """The fixtures of family ``name`` (a declared family without them is an error the tests report)."""
    return importlib.import_module(f"{__name__}.{name}")


def fixtures() -> dict[str, ModuleType]:
    """Every declared family's fixtures, by name (read afresh from the declarations at each call)."""
    return {name: fixture_file(name) for name in declarations()}
