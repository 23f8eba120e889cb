"""The command-line programs, at the top of the package: training (``train.py``, :mod:`deqscore.cli.train`), sampling
with FID and KID (``sample.py``, :mod:`deqscore.cli.sample`, :mod:`deqscore.cli.fid_job`) and their one-line usage
errors (:mod:`deqscore.cli.errors`). Nothing below this package imports from it."""
