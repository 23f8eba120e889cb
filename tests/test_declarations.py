"""One declaration per family (deqscore/families/<name>.py), and every place that should come from it does: the
training registry, the config folders, the benchmark sections, the depth section, the study and the test
fixtures. A family missing from one of them, or known to one of them without a declaration, fails here."""

import importlib

import pytest

from deqlab.depth import depth_families
from deqlab.families import family_file
from deqlab.sections import ACROSS_FAMILIES, GENERIC_SECTIONS, section_funcs
from deqlab.study import families as study_families
from deqscore.configfiles import is_base, load_config
from deqscore.families import ROOT, declarations
from deqscore.lightning import family_registry
from tests.deq.test_family_phantom import FAMILIES as PHANTOM_FAMILIES
from tests.lightning.conftest import FAMILY_TINY

DECLARED = declarations()


def test_the_training_registry_holds_exactly_the_declared_families():
    registry = family_registry()
    assert set(registry) == set(DECLARED)
    for name, declared in DECLARED.items():
        module, _, cls = declared.module.rpartition(".")
        assert getattr(importlib.import_module(module), cls) is registry[name]


def test_every_config_belongs_to_exactly_one_declared_family():
    folders = {p.name for p in (ROOT / "configs").iterdir() if p.is_dir()}
    assert folders == set(DECLARED)
    owned = [c for d in DECLARED.values() for c in d.all_configs()]
    runnable = [p for p in (ROOT / "configs").rglob("*.yaml") if not is_base(p)]
    assert sorted(owned) == sorted(runnable) and len(set(owned)) == len(owned)


def test_a_family_file_in_the_lightning_package_registers_without_an_import_elsewhere(tmp_path, monkeypatch):
    import sys

    import deqscore.lightning as package
    from deqscore.lightning import base

    (tmp_path / "toy_family.py").write_text(
        "from deqscore.lightning.base import ScoreModule\n\nclass ToyModule(ScoreModule):\n    family = 'toy'\n")
    monkeypatch.setattr(package, "__path__", [*package.__path__, str(tmp_path)])
    monkeypatch.setattr(base, "_FAMILIES", dict(base._FAMILIES))
    monkeypatch.delitem(sys.modules, "deqscore.lightning.toy_family", raising=False)
    base._import_package_modules.cache_clear()
    try:
        assert family_registry()["toy"].__name__ == "ToyModule"
    finally:
        base._import_package_modules.cache_clear()
        sys.modules.pop("deqscore.lightning.toy_family", None)


@pytest.mark.parametrize("name", sorted(DECLARED))
def test_a_declarations_configs_exist_and_build_its_module(name):
    declared = DECLARED[name]
    cls = declared.module.rpartition(".")[2]
    for path in declared.all_configs():
        assert load_config(path)["model"]["class_path"].rpartition(".")[2] == cls, path
    for role in declared.configs:
        assert (ROOT / declared.config(role)).is_file()
    for entry in declared.depth.values():
        assert (ROOT / entry.config).is_file()
    if declared.study is not None:
        for variant in declared.study.variants.values():
            assert (ROOT / declared.variant_config(variant)).is_file()


def test_the_benchmark_the_depth_section_the_study_and_the_fixtures_read_the_declarations():
    sections = section_funcs()
    lab_files = {p.stem for p in (ROOT / "lab" / "deqlab" / "families").glob("[!_]*.py")}
    assert lab_files <= set(DECLARED)  # a laboratory file is keyed by a declared family's name
    assert set(sections) == set(GENERIC_SECTIONS) | {n for n in DECLARED if family_file(n)} | set(ACROSS_FAMILIES)
    assert {n for n in DECLARED if family_file(n)} == lab_files
    assert set(depth_families()) == {key for d in DECLARED.values() for key in d.depth}
    assert set(study_families()) == {n for n, d in DECLARED.items() if d.study is not None}
    assert set(FAMILY_TINY) == set(DECLARED)
    # every family with a DEQ config declares a probe of its phantom steps, checked by hand
    assert set(PHANTOM_FAMILIES) == {n for n, d in DECLARED.items() if "deq" in d.configs}
