"""A usage error carries the option it is about (``key``), which the command line turns into the option to write;
the checks give it the option's name, not the label before it."""

import pickle

import pytest

from deqscore.data.errors import DataNotFoundError
from deqscore.errors import ConfigError, check_count, check_real, choice_error


@pytest.mark.parametrize(("check", "value", "key"), [
    (lambda v: check_real("DEQ tol", v), -1.0, "tol"),
    (lambda v: check_real("sigma_min", v, high=1.0), 2.0, "sigma_min"),
    (lambda v: check_count("VAEModule ais_steps", v), 0, "ais_steps"),
    (lambda v: check_count("n_levels", v, low=2), 1, "n_levels"),
])
def test_a_failed_check_names_its_option(check, value, key):
    with pytest.raises(ConfigError) as caught:
        check(value)
    assert caught.value.key == key


def test_a_check_with_another_error_class_raises_that_class():
    with pytest.raises(ValueError) as caught:
        check_count("AIS n_steps", 0, error=ValueError)
    assert type(caught.value) is ValueError and "AIS n_steps must be >= 1" in str(caught.value)


def test_the_key_survives_pickling_as_across_processes():
    for err in (choice_error("DEQ solver", "newton", ["anderson"]), DataNotFoundError("no file", key="data_dir")):
        again = pickle.loads(pickle.dumps(err))
        assert (type(again), str(again), again.key) == (type(err), str(err), err.key)
    assert ConfigError("message alone").key is None
