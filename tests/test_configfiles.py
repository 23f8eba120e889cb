"""Configs that compose (deqscore.configfiles): a base's options overridden key by key, lists replaced whole, named
callbacks composed by name, and no block of options written in more than two of the shipped config files."""

import json
from collections import defaultdict

import pytest
import yaml

from deqscore import configfiles
from deqscore.cli.train import main, run
from deqscore.configfiles import (
    ConfigFileError,
    composed_command_line,
    composed_text,
    composes,
    is_base,
    load_config,
)
from deqscore.families import ROOT


def write(path, content):
    path.write_text(yaml.safe_dump(content))
    return path


def test_a_config_overrides_its_bases_key_by_key_and_replaces_lists(tmp_path):
    write(tmp_path / "_a.yaml", {"trainer": {"max_epochs": 10, "callbacks": [1, 2]}, "seed_everything": 1})
    write(tmp_path / "_b.yaml", {"base": "_a.yaml", "trainer": {"log_every_n_steps": 5}})
    run_config = write(tmp_path / "run.yaml", {"base": ["_b.yaml"], "trainer": {"max_epochs": 2, "callbacks": [3]},
                                               "model": {"init_args": {"x": 1}, "class_path": "m.M"}})
    assert load_config(run_config) == {"trainer": {"max_epochs": 2, "callbacks": [3], "log_every_n_steps": 5},
                                       "seed_everything": 1, "model": {"class_path": "m.M", "init_args": {"x": 1}}}
    assert list(load_config(run_config)["model"]) == ["class_path", "init_args"]  # as configs write it
    assert yaml.safe_load(composed_text(run_config)) == load_config(run_config)


def test_named_callbacks_compose_by_name_and_become_the_trainers_list(tmp_path):
    checkpoint = {"class_path": "pytorch_lightning.callbacks.ModelCheckpoint", "init_args": {"save_last": True}}
    write(tmp_path / "_a.yaml", {"trainer": {"callbacks": {"checkpoint": checkpoint, "curves": {"class_path": "C"}}}})
    run_config = write(tmp_path / "run.yaml", {"base": "_a.yaml", "trainer": {"callbacks": {
        "checkpoint": {"init_args": {"monitor": "val/loss"}}, "curves": None, "ema": {"class_path": "E"}}}})
    assert load_config(run_config)["trainer"]["callbacks"] == [
        {"class_path": checkpoint["class_path"], "init_args": {"save_last": True, "monitor": "val/loss"}},
        {"class_path": "E"}]
    assert composes(run_config) and not composes(write(tmp_path / "plain.yaml", {"trainer": {"callbacks": []}}))


def test_named_callbacks_compose_across_the_config_files_of_one_command_line(tmp_path):
    write(tmp_path / "_a.yaml", {"trainer": {"callbacks": {"checkpoint": {"class_path": "M", "init_args": {"k": 1}},
                                                           "curves": {"class_path": "C"}}}})
    first = write(tmp_path / "first.yaml", {"base": "_a.yaml", "seed_everything": 3})
    second = write(tmp_path / "second.yaml", {"trainer": {"callbacks": {"checkpoint": {"init_args": {"j": 2}},
                                                                        "curves": None, "ema": {"class_path": "E"}}}})
    plain = write(tmp_path / "plain.yaml", {"trainer": {"max_epochs": 1}})
    listed = write(tmp_path / "listed.yaml", {"trainer": {"callbacks": [{"class_path": "L"}]}})
    texts, callbacks = composed_command_line([first, plain, second])
    assert texts[1] is None  # nothing to compose: the parser reads the file itself
    assert yaml.safe_load(texts[2])["trainer"]["callbacks"] == [  # the parser takes the last list whole
        {"class_path": "M", "init_args": {"k": 1, "j": 2}}, {"class_path": "E"}]
    # a file that lists its callbacks replaces them: a later file's named ones compose on nothing
    with pytest.raises(ConfigFileError, match="trainer.callbacks.checkpoint names no class_path"):
        composed_command_line([first, listed, second])


def test_a_second_config_on_the_command_line_changes_a_callback_of_the_first_by_name(tmp_path, capsys):
    extra = write(tmp_path / "extra.yaml", {"trainer": {"callbacks": {"checkpoint": {"init_args": {
        "every_n_train_steps": 7}}}}})
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(ROOT / "configs" / "nice" / "explicit.yaml"), "--config", str(extra),
              "--print_config"])
    callbacks = yaml.safe_load(capsys.readouterr().out)["trainer"]["callbacks"]
    checkpoint = next(c["init_args"] for c in callbacks if c["init_args"].get("monitor") == "val/loss")
    assert checkpoint["every_n_train_steps"] == 7 and checkpoint["save_last"]  # the base's options stay
    assert {"deqscore.lightning.LearningCurves", "deqscore.lightning.SampleGrid"} <= {c["class_path"] for c in
                                                                                     callbacks}  # and its callbacks


@pytest.mark.parametrize(("files", "message"), [
    ({"run.yaml": {"base": "_missing.yaml"}}, "its base _missing.yaml is not a file"),
    ({"run.yaml": {"base": "_a.yaml"}, "_a.yaml": {"base": "run.yaml"}}, "its bases name it again"),
    ({"run.yaml": {"base": "_a.yaml"}, "_a.yaml": ["not", "a", "mapping"]}, "the file is a YAML list"),
    ({"run.yaml": {"base": "_a.yaml", "trainer": {"callbacks": {"chekpoint": {"init_args": {"monitor": "x"}}}}},
      "_a.yaml": {"trainer": {"callbacks": {"checkpoint": {"class_path": "M"}}}}},
     "trainer.callbacks.chekpoint names no class_path; the callbacks with one here: checkpoint"),
])
def test_a_base_that_cannot_be_composed_is_one_line_naming_the_file(tmp_path, capsys, files, message):
    for name, content in files.items():
        write(tmp_path / name, content)
    with pytest.raises(ConfigFileError, match=message):
        load_config(tmp_path / "run.yaml")
    assert run(["fit", "--config", str(tmp_path / "run.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_the_shipped_bases_compose_and_are_never_run_alone():
    bases = [p for p in (ROOT / "configs").rglob("*.yaml") if is_base(p)]
    assert len(bases) >= 5
    composing = [p for p in (ROOT / "configs").rglob("*.yaml") if not is_base(p) and "base" in yaml.safe_load(
        p.read_text())]
    assert len(composing) >= 20
    for path in composing:
        config = load_config(path)
        assert {"model", "data", "trainer"} <= set(config) and "base" not in config, path


def blocks(node, path=()):
    """Every block of options in a config file as (where, what): each mapping below the top, each top-level value
    (``seed_everything: 2019``); list items are placed by their list, not their index."""
    if isinstance(node, dict):
        if path and node:
            yield path, json.dumps(node, sort_keys=True)
        for key, value in node.items():
            if not path and key != "base" and not isinstance(value, dict | list):
                yield (key,), json.dumps(value)
            yield from blocks(value, (*path, key))
    elif isinstance(node, list):
        for value in node:
            yield from blocks(value, (*path, "[]"))


def repeated_blocks(folder, at_most: int = 2) -> dict:
    where = defaultdict(set)
    for path in sorted(folder.rglob("*.yaml")):
        for block in blocks(yaml.safe_load(path.read_text())):
            where[block].add(path.relative_to(folder).as_posix())
    return {block: sorted(files) for block, files in where.items() if len(files) > at_most}


def test_no_block_of_options_is_written_in_more_than_two_config_files(tmp_path):
    assert not repeated_blocks(ROOT / "configs")
    # the check can fail: one checkpoint block written out in three files
    block = {"trainer": {"callbacks": [{"class_path": "M", "init_args": {"save_last": True}}]}, "seed_everything": 1}
    for name in ("a", "b", "c"):
        write(tmp_path / f"{name}.yaml", {**block, "run_name": name})
    assert set(repeated_blocks(tmp_path)) == {
        (("seed_everything",), "1"), (("trainer",), json.dumps(block["trainer"], sort_keys=True)),
        (("trainer", "callbacks", "[]"), json.dumps(block["trainer"]["callbacks"][0], sort_keys=True)),
        (("trainer", "callbacks", "[]", "init_args"), '{"save_last": true}')}


# ----- bases: runnable configs, shipped configs from anywhere, copies --------------------------------------------
def test_a_runnable_config_is_a_base():
    reference, deq = load_config(ROOT / "configs/dkef/deq_reference.yaml"), load_config(ROOT / "configs/dkef/deq.yaml")
    assert not is_base(ROOT / "configs/dkef/deq.yaml")  # a runnable config
    deq["run_name"] = "dkef_deq_reference"
    deq["model"]["init_args"]["net"]["init_args"]["deq"]["init_args"]["injection_prestep"] = True
    assert reference == deq  # deq.yaml plus the pre-step, nothing written twice


def test_a_shipped_config_is_a_base_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    mine = write(tmp_path / "elsewhere" / "mine.yaml", {"base": "deqscore:dkef/deq.yaml", "run_name": "mine",
                                                        "data": {"init_args": {"dataset": "highdim"}}})
    expected = load_config(ROOT / "configs/dkef/deq.yaml")
    expected["run_name"], expected["data"]["init_args"]["dataset"] = "mine", "highdim"
    assert load_config(mine) == expected
    write(mine, {"base": "deqscore:dkef/nothing.yaml"})
    with pytest.raises(ConfigFileError, match="its base deqscore:dkef/nothing.yaml is not a shipped config"):
        load_config(mine)
    monkeypatch.setattr(configfiles, "SHIPPED_CONFIGS", tmp_path / "no-configs")  # an installation without them
    write(mine, {"base": "deqscore:dkef/deq.yaml"})
    with pytest.raises(ConfigFileError, match="there are none beside this installation .*; copy that file beside "
                                              "mine.yaml and name it by its file name"):
        load_config(mine)


@pytest.mark.parametrize(("shipped", "suggestion"), [("ncsn/deq_mnist.yaml", "deqscore:ncsn/_mnist.yaml"),
                                                     ("vae/deq_mnist.yaml", "deqscore:vae/_implicit_mnist.yaml"),
                                                     ("dkef/deq_reference.yaml", "deqscore:dkef/deq.yaml"),
                                                     ("dkef/deq.yaml", "deqscore:dkef/_dkef.yaml")])
def test_a_config_copied_out_of_configs_says_in_one_line_what_to_write(tmp_path, capsys, shipped, suggestion):
    copy = tmp_path / "copy.yaml"
    copy.write_bytes((ROOT / "configs" / shipped).read_bytes())
    assert run(["fit", "--config", str(copy)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.rstrip().endswith(f"a config copied out of configs/ names a shipped base from anywhere: write base: "
                                 f"{suggestion}"), err
    # and what it says works: the copy then means what the shipped config means
    text = copy.read_text()
    old = yaml.safe_load(text)["base"]
    copy.write_text(text.replace(f"base: {old}", f"base: {suggestion}"))
    assert load_config(copy) == load_config(ROOT / "configs" / shipped)


@pytest.mark.parametrize("config", ["dkef/deq.yaml", "ncsn/deq_cifar10.yaml"])
def test_print_config_shows_the_samplers_settings_and_no_ignored_dimension(config, capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(ROOT / "configs" / config), "--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    sampler = printed["model"]["init_args"]["sampler"]
    expected = {"dkef/deq.yaml": ("deqscore.sampling.Langevin", {"n_steps", "step_size", "metropolis"}),
                "ncsn/deq_cifar10.yaml": ("deqscore.sampling.AnnealedLangevin", {"n_steps_each", "step_lr"})}[config]
    assert sampler["class_path"] == expected[0] and expected[1] <= set(sampler["init_args"])
    assert printed["data"]["init_args"].get("dim") is None  # the network's dim is the data's, linked
