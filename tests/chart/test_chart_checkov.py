"""checkov (--framework kubernetes) on the rendered manifests: zero failed checks.

The default values run with charts/amprl/.checkov.yaml, whose every skip carries a written
reason; the production value set (digests pinned, TLS, existing Redis secret, GPU) runs
with no skips at all. checkov takes seconds per run, so each set is scanned once.
"""

from __future__ import annotations

import re

import pytest
import yaml

from chartkit import CHART, strip_source
from chart_tools import run_checkov

CONFIG = CHART / ".checkov.yaml"
SCANS = {"defaults": True, "pinned": False}  # value set -> with the skip config


@pytest.fixture(scope="module")
def checkov_reports(rendered, tmp_path_factory):
    reports = {}
    for value_set, with_config in SCANS.items():
        folder = tmp_path_factory.mktemp(f"manifests-{value_set}")
        docs, _ = rendered[value_set]
        for i, doc in enumerate(docs):
            (folder / f"{i:02d}-{doc['kind'].lower()}.yaml").write_text(
                yaml.safe_dump(strip_source(doc), sort_keys=False))
        args = ["--framework", "kubernetes", "-d", str(folder)]
        if with_config:
            args += ["--config-file", str(CONFIG)]
        reports[value_set] = (run_checkov(*args), len(docs))
    return reports


@pytest.mark.parametrize("value_set", sorted(SCANS))
def test_checkov_finds_no_failed_checks(checkov_reports, value_set):
    reports, n_docs = checkov_reports[value_set]
    assert reports, "checkov produced no report"
    failed = [f"{c['check_id']} {c['check_name']}: {c['resource']}"
              for r in reports for c in r.get("results", {}).get("failed_checks", [])]
    summary = reports[0]["summary"]
    assert summary["parsing_errors"] == 0, summary
    assert summary["passed"] > 100, summary  # it really ran its checks
    assert summary["resource_count"] >= n_docs - 2, summary
    assert not failed, "\n".join(failed)


def test_every_checkov_skip_has_a_written_reason():
    lines = CONFIG.read_text().splitlines()
    skips = [(i, m.group(1)) for i, ln in enumerate(lines)
             if (m := re.match(r"^\s*-\s*(CKV\w*_\d+)\s*$", ln))]
    assert skips, "no skips listed; delete the config file instead"
    listed = yaml.safe_load(CONFIG.read_text())["skip-check"]
    assert [s for _, s in skips] == listed
    for i, check_id in skips:
        reason = []
        j = i - 1
        while j >= 0 and lines[j].strip().startswith("#"):
            reason.insert(0, lines[j])
            j -= 1
        text = " ".join(reason)
        assert check_id in text and len(text) > 80, f"{check_id}: no reason above the skip"
