"""One family registry, the declarations (deqscore/families/<name>.py), and every place that should come from it
does: the training registry, the config folders, the test fixtures (tests/families/<name>.py) and the
laboratory's entries, benchmark sections and study, all keyed by the family's name. A family known to one of them
without a declaration fails here, and hiding a declaration removes the family from all of them."""

import importlib
import shutil
import sys
from pathlib import Path

import pytest
import torch

from deqlab.depth import depth_families
from deqlab.entries import DEPTHS, STUDIES
from deqlab.families import family_file
from deqlab.sections import ACROSS_FAMILIES, GENERIC_SECTIONS, section_funcs
from deqlab.study.families import families as study_families
from deqscore import families as families_package
from deqscore.configfiles import is_base, load_config
from deqscore.families import ROOT, declarations
from deqscore.lightning import CheckpointFamilyError, family_registry
from deqscore.lightning.base import FAMILY_KEY, family_of
from deqscore.lightning.checkpoint import read_checkpoint
from tests.deq import test_family_phantom
from tests.lightning.conftest import family_tiny

DECLARED = declarations()


def test_the_training_registry_is_the_declarations():
    registry = family_registry()
    assert set(registry) == set(DECLARED)
    for name, declared in DECLARED.items():
        module, _, cls = declared.module.rpartition(".")
        assert getattr(importlib.import_module(module), cls) is registry[name]
        assert family_of(registry[name]) == name  # the checkpoint's family tag comes from the declaration


def test_every_config_belongs_to_exactly_one_declared_family():
    folders = {p.name for p in (ROOT / "configs").iterdir() if p.is_dir()}
    assert folders == set(DECLARED)
    owned = [c for d in DECLARED.values() for c in d.all_configs()]
    runnable = [p for p in (ROOT / "configs").rglob("*.yaml") if not is_base(p)]
    assert sorted(owned) == sorted(runnable) and len(set(owned)) == len(owned)


@pytest.mark.parametrize("name", sorted(DECLARED))
def test_a_declarations_configs_exist_and_build_its_module(name):
    declared = DECLARED[name]
    cls = declared.module.rpartition(".")[2]
    for path in declared.all_configs():
        assert load_config(path)["model"]["class_path"].rpartition(".")[2] == cls, path
    for role in declared.configs:
        assert (ROOT / declared.config(role)).is_file()
    for entry in DEPTHS.get(name, {}).values():
        assert (ROOT / entry.config).is_file()
    if name in STUDIES:
        for variant in STUDIES[name].variants.values():
            assert (ROOT / variant.config_path(declared)).is_file()


def test_fixtures_and_laboratory_entries_are_keyed_by_declared_families():
    fixture_files = {p.stem for p in (ROOT / "tests" / "families").glob("[!_]*.py")}
    lab_files = {p.stem for p in (ROOT / "lab" / "deqlab" / "families").glob("[!_]*.py")}
    assert fixture_files == set(DECLARED), "every declared family has its fixtures, and only those"
    assert lab_files <= set(DECLARED) and set(DEPTHS) <= set(DECLARED) and set(STUDIES) <= set(DECLARED)
    sections = section_funcs()  # a family's laboratory file gives a section where it defines one
    with_section = {name for name in lab_files if hasattr(family_file(name), "section")}
    assert set(sections) == set(GENERIC_SECTIONS) | with_section | set(ACROSS_FAMILIES)
    assert with_section and lab_files - with_section == {"edm"}  # EDM's file: its study evaluation alone
    assert set(depth_families()) == {key for entries in DEPTHS.values() for key in entries}
    assert set(study_families()) == set(STUDIES)
    assert set(family_tiny()) == set(DECLARED)
    # every family with a DEQ config has a probe of its phantom steps, checked by hand
    assert set(test_family_phantom.FAMILIES) == {n for n, d in DECLARED.items() if "deq" in d.configs}


def test_a_declaration_in_a_new_file_is_a_family(tmp_path, monkeypatch):
    (tmp_path / "toy_module.py").write_text(
        "from deqscore.lightning.base import ScoreModule\n\nclass ToyModule(ScoreModule):\n    pass\n")
    declared = tmp_path / "declared"
    declared.mkdir()
    (declared / "toy.py").write_text(
        "from deqscore.families import Declaration\n\n"
        "DECLARATION = Declaration(name='toy', module='toy_module.ToyModule', configs={})\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(families_package, "__path__", [*families_package.__path__, str(declared)])
    try:
        registry = family_registry()
        assert registry["toy"].__name__ == "ToyModule" and family_of(registry["toy"]) == "toy"
    finally:
        sys.modules.pop("deqscore.families.toy", None)
        sys.modules.pop("toy_module", None)


def test_hiding_a_declaration_removes_the_family_everywhere(tmp_path, monkeypatch):
    hidden = "vae"
    for file in Path(families_package.__file__).parent.glob("*.py"):
        if file.stem != hidden:
            shutil.copy(file, tmp_path / file.name)
    monkeypatch.setattr(families_package, "__path__", [str(tmp_path)])
    study_families.cache_clear()
    try:
        assert set(declarations()) == set(DECLARED) - {hidden}
        registry = family_registry()
        assert hidden not in registry and set(registry) == set(DECLARED) - {hidden}
        module, _, cls = DECLARED[hidden].module.rpartition(".")
        assert family_of(getattr(importlib.import_module(module), cls)) == ""  # its checkpoints get no family tag
        checkpoint = tmp_path / "vae.ckpt"
        torch.save({FAMILY_KEY: hidden, "state_dict": {}}, checkpoint)
        with pytest.raises(CheckpointFamilyError, match="not a deqscore checkpoint"):
            read_checkpoint(checkpoint)  # load_module and sample.py read checkpoints through it
        assert hidden not in family_tiny()
        assert hidden not in section_funcs() and hidden not in study_families()
        assert not any(key.startswith(hidden) for key in depth_families())
    finally:
        monkeypatch.undo()
        study_families.cache_clear()
    assert hidden in family_registry() and hidden in study_families()  # restored: the hiding was the cause
