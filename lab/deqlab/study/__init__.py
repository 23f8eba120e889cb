"""The reproduction study: every variant of a family (shallow explicit, deep explicit, the DEQ and its reference
design) trained with the same budget over several seeds, evaluated on the test split through the project's own
commands, and written up from the recorded results alone.

Run::

    python -m deqlab study --family dkef --groups redwine   # the protocol's budget, seeds and variants
    python -m deqlab study --family nice --variants explicit,deq --seeds 0
    python -m deqlab study --report                         # docs/results.md from the unit files

The protocol (``benchmarks/protocol/v<N>.json``, the newest by default; :mod:`.protocol`) fixes each family's
budget, the seeds of each variant, the evaluation sizes, the options every fit shares, the learning-rate grid and
the thread count; ``--budget``, ``--seeds``, ``--set`` and ``--config-rates`` depart from it (for trials: the
report marks such units off-protocol, and refuses a seed the protocol does not list). Each arm's learning rate is
chosen first from tuning runs (:mod:`.tuning`). Each
(family, data set, variant, seed) is one unit: ``train.py fit`` of the variant's config for ``budget x`` the
family's training iterations (run directory ``<runs-root>/<family>/<data>/<variant>_s<seed>``), then the family's
evaluation of its final weights (see :mod:`deqlab.study.evaluation`), recorded as
``<out>/<family>/<data>/<variant>_s<seed>.json``. A unit already recorded with the same settings is read back
instead of run again, so a study longer than one sitting continues where it stopped (a unit stopped part-way
continues from its run's checkpoint where its launch is the same, :func:`.core.resumable`); a unit recorded with
other settings, config, arguments or code of the family is run again and replaced (:func:`.core.run_unit`); one
of an earlier design is kept under ``<data>/v<version>/`` and judged apart (:func:`.core.keep_earlier`).
Units run seed by seed, each seed's variants in the family's order, so an interrupted study has whole seeds of the
first variants. ``--rerun`` records the named units again under ``<data>/reruns/`` (the page's run-to-run spread).
``--extra`` passes arguments to every fit.
"""
