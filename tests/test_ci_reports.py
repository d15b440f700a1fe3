"""The reports for CI: the Markdown summary fits 40 lines whatever the number of failures, the
JUnit XML parses with a verdict on every case (failures with their message, n/a cells
skipped with the reason), GitHub's annotations escape what its workflow commands read, and
the pytest plugin's tests land in pytest's own JUnit XML as ordinary test cases."""

from __future__ import annotations

import copy
import xml.etree.ElementTree as ET
from importlib.metadata import entry_points

import pytest
import torch
from torch import nn

import torchparity as tp
import toy_repo
from torchparity.ci import check_outcome, diagnosis_outcome, junit_xml, publish, summary_markdown
from torchparity.ci.writers import annotations
from torchparity.cli import main
from torchparity.diagnosis.core.results import module_label
from torchparity.golden.cells import CheckResult


def result(output: str, verdict: str, backend: str = "sdpa", **details) -> CheckResult:
    ok = verdict in ("identical", "within", "n/a")
    return CheckResult(case="models.make", backend=backend, dtype="fp32", device="cpu",
                       output=output, kind="forward", verdict=verdict,
                       headroom=None if verdict == "n/a" else (3.0 if not ok else 0.25),
                       ok=ok, **details)


def verdicts(xml: str) -> dict[str, tuple[str, str | None]]:
    """``{name: (verdict property, failure/skipped/None)}`` of every test case."""
    found = {}
    for case in ET.fromstring(xml).iter("testcase"):
        outcome = next((child.tag for child in case if child.tag in ("failure", "skipped")),
                       None)
        found[case.get("name")] = (case.find("properties/property[@name='verdict']")
                                   .get("value"), outcome)
    return found


@pytest.mark.parametrize("failures", [1, 37, 200])
def test_the_summary_fits_40_lines_and_says_how_many_rows_it_left_out(failures):
    results = [result(f"out{i}", "diverged", explain=f"diverged: line one\nline two {i}")
               for i in range(failures)] + [result("loss", "within")]
    markdown = summary_markdown(check_outcome(results, "models.py:make against base main"))
    lines = markdown.splitlines()
    assert len(lines) <= 40
    assert lines[0] == "### ❌ torchparity check"
    shown = [line for line in lines if line.startswith("| `models.make`")]
    left_out = failures - len(shown)
    assert (f"{left_out} more rows: see --junit or --json" in markdown) == (left_out > 0)
    assert f"FAIL: {failures} of {failures + 1} outputs diverged" in markdown


def test_junit_has_a_verdict_on_every_case_failures_with_their_message_and_skips():
    results = [result("outputs", "diverged", explain="diverged: worst at (0, 1)"),
               result("grads", "n/a", backend="flex", reason="flex has no backward pass"),
               result("loss", "identical")]
    found = verdicts(junit_xml(check_outcome(results, "models.py:make")))
    assert found == {"sdpa fp32 cpu outputs": ("diverged", "failure"),
                     "flex fp32 cpu grads": ("could not run", "skipped"),
                     "sdpa fp32 cpu loss": ("identical", None)}
    root = ET.fromstring(junit_xml(check_outcome(results, "models.py:make")))
    suite = root.find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("3", "1", "1")
    assert root.find(".//failure").get("message") == "diverged: worst at (0, 1)"


def test_under_github_actions_a_failure_is_an_escaped_error_annotation(monkeypatch, capsys,
                                                                       tmp_path):
    results = [result(f"out{i}", "diverged", explain="100% over\nbudget") for i in range(12)]
    outcome = check_outcome(results, "models.py:make")
    monkeypatch.delenv("GITHUB_ACTIONS", raising=False)
    publish(outcome)
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    summary = tmp_path / "step_summary.md"
    summary.write_text("earlier step\n")
    publish(outcome, summary=str(summary))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 11 and all(line.startswith("::error title=torchparity check::")
                                    for line in lines)
    assert lines[0].endswith("models.make sdpa fp32 cpu out0: 100%25 over%0Abudget")
    assert lines[-1].endswith("2 more failures: see the job's log")
    assert summary.read_text().startswith("earlier step\n\n### ❌ torchparity check")


def test_a_diagnosis_has_a_case_per_module_and_fails_the_first_divergence():
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    b = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        b[2].bias.add_(0.1)  # B's last layer computes something else
    report = tp.diagnose(a, b, (torch.randn(3, 4),), backward=False)
    outcome = diagnosis_outcome(report, "b against a")
    found = verdicts(junit_xml(outcome))
    assert set(found) == {row.module or "(model)" for row in report.rows}
    assert found["2"] == ("diverged", "failure")
    assert found["0"][1] is None and found["1"][1] is None
    markdown = summary_markdown(outcome)
    assert "the first divergence is `2`" in markdown and len(markdown.splitlines()) <= 40
    [annotation] = annotations(outcome)  # one for the diagnosis, not one per module
    assert annotation.startswith("::error title=torchparity diagnose::First divergence: 2 ")


def _biased_at(layer: int) -> tuple[nn.Module, nn.Module, tuple[torch.Tensor]]:
    """A small MLP, the same MLP with one layer's bias moved by 0.1, and an input."""
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    b = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        b[layer].bias.add_(0.1)
    return a, b, (torch.randn(3, 4),)


def test_junit_fails_where_the_divergence_enters_and_every_case_has_a_time():
    """B changes its first layer only: the later modules' own local errors are identical,
    their outputs in B's run are not. Only the first layer fails; the others pass with a
    note saying their output diverged by inheritance, and where it entered."""
    report = tp.diagnose(*_biased_at(0), backward=False, local="all")
    rows = {row.module: row for row in report.rows}
    assert rows["2"].local.verdict == "identical" and not rows["2"].propagated.ok
    xml = junit_xml(diagnosis_outcome(report, "b against a", seconds=2.0))
    found = verdicts(xml)
    assert found["0"] == ("diverged", "failure")
    assert found["1"] == ("diverged", None) and found["2"] == ("diverged", None)
    # The model's replay diverges too, but only because it contains layer 0.
    assert found["(model)"] == ("diverged", None)
    root = ET.fromstring(xml)
    assert sum(1 for _ in root.iter("failure")) == 1
    note = root.find(".//testcase[@name='2']/system-out").text
    assert "inherited: its output in B's own run diverged" in note
    assert note.endswith("its own local error is identical; it enters at 0")
    assert "because it contains 0," in root.find(".//testcase[@name='(model)']/system-out").text
    times = [float(case.get("time")) for case in root.iter("testcase")]
    assert root.find("testsuite").get("time") == "2.000"
    # Each share is printed to the millisecond: the shares add up to the suite's time.
    assert all(t > 0 for t in times) and abs(sum(times) - 2.0) <= len(times) * 0.0005


class _SteeperBackward(torch.autograd.Function):
    """The identity forward, a backward 2% too steep."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.02


class _Steeper(nn.Module):
    def forward(self, x):
        return _SteeperBackward.apply(x)


def test_junit_fails_the_module_whose_gradient_alone_diverges():
    a, _, inputs = _biased_at(0)
    b = copy.deepcopy(a)
    b[1] = nn.Sequential(nn.Tanh(), _Steeper())  # same forward, a steeper gradient
    report = tp.diagnose(a, b, inputs, loss_fn=lambda out, _: out.square().sum(),
                         local="all")
    assert report.first_divergence is None and report.first_grad_divergence is not None
    found = verdicts(junit_xml(diagnosis_outcome(report, "b against a")))
    failed = {name for name, (_, outcome) in found.items() if outcome == "failure"}
    assert failed == {module_label(report.first_grad_divergence.module)}, found


def test_a_failing_summary_opens_with_a_plain_sentence_and_the_next_command():
    formula = ("diverged: max-abs error 7.18e-05 exceeds the budget 4.47e-15 = 6 × baseline "
               "error 6.66e-16 + floor 4.73e-16")
    results = [result("outputs", "diverged", explain=formula), result("loss", "within")]
    outcome = check_outcome(results, "models.py:make against base main",
                            next_step="torchparity diagnose models.py:make --base main")
    lines = summary_markdown(outcome).splitlines()
    assert lines[2] == ("The outputs of `models.make` changed: 1 of 2 outputs diverged; the "
                        "worst, `outputs` in sdpa fp32 cpu, used 300% of its budget.")
    assert lines[4] == "Next: `torchparity diagnose models.py:make --base main`"
    assert formula not in "\n".join(lines)  # the formula is the JUnit message's, not here
    assert formula in junit_xml(outcome)


def test_the_diagnosis_summary_explains_its_cells():
    report = tp.diagnose(*_biased_at(2), backward=False)
    markdown = summary_markdown(diagnosis_outcome(report, "b against a",
                                                  next_step="torchparity diagnose a b --html x"))
    lines = markdown.splitlines()
    assert lines[2].startswith("The model changed in `2` (Linear): its own error is ")
    assert lines[4] == "Next: `torchparity diagnose a b --html x`"
    cells = {cell.strip() for line in lines if line.startswith("| `")
             for cell in line.split("|")[3:5]}
    assert any(cell.startswith("X ") for cell in cells)
    legend = lines[-1]
    for symbol in ("=: bit-identical", "X n: diverged", "<n: within", "-: not computed"):
        assert symbol in legend


PLUGIN_TESTS = '''
import os

import torch


def test_same(golden):
    golden.check("y", torch.linspace(-1, 1, 8))


def test_changed(golden):
    golden.check("y", torch.linspace(-1, 1, 8) + float(os.environ.get("SHIFT", "0")))
'''


def test_the_plugins_tests_land_in_pytests_own_junit_xml(pytester, monkeypatch):
    installed = any(ep.name == "torchparity" for ep in entry_points(group="pytest11"))
    plugin = () if installed else ("-p", "torchparity.pytest_plugin")
    pytester.makepyfile(test_user=PLUGIN_TESTS)
    pytester.runpytest_inprocess("-p", "no:cacheprovider", *plugin,
                                 "--torchparity-golden-update")
    monkeypatch.setenv("SHIFT", "1e-3")
    junit = pytester.path / "junit.xml"
    outcome = pytester.runpytest_inprocess("-p", "no:cacheprovider", *plugin,
                                           f"--junitxml={junit}")
    outcome.assert_outcomes(passed=1, failed=1)
    cases = {case.get("name"): case for case in ET.parse(junit).getroot().iter("testcase")}
    assert set(cases) == {"test_same", "test_changed"}
    assert cases["test_same"].find("failure") is None
    assert "golden 'y': diverged" in cases["test_changed"].find("failure").get("message")


def test_check_and_diagnose_write_their_reports_without_base(tmp_path, monkeypatch, capsys):
    """The same file twice: A and B agree, so the reports say so, as files CI can read."""
    models = tmp_path / "models.py"
    models.write_text(toy_repo.MODELS)
    monkeypatch.chdir(tmp_path)
    summary, junit = tmp_path / "summary.md", tmp_path / "diagnose.xml"
    assert main(["diagnose", "models.py:make", "models.py:make", "--summary", str(summary),
                 "--junit", str(junit)]) == 0
    assert summary.read_text().startswith("### ✅ torchparity diagnose\n")
    cases = list(ET.parse(junit).getroot().iter("testcase"))
    assert cases and all(c.find("failure") is None for c in cases)
    capsys.readouterr()


def test_the_next_command_is_never_the_one_just_run(tmp_path, monkeypatch, capsys):
    """A failing diagnosis points at the command that writes the HTML page; once the page
    was asked for, the summary names it instead of the same command again."""
    before, after = toy_repo.CHANGES["real"]
    (tmp_path / "a.py").write_text(toy_repo.MODELS)
    (tmp_path / "b.py").write_text(toy_repo.MODELS.replace(before, after))
    monkeypatch.chdir(tmp_path)
    command = ["diagnose", "a.py:make", "b.py:make", "--no-backward"]
    assert main([*command, "--summary", "plain.md"]) == 1
    assert "Next: `torchparity diagnose a.py:make b.py:make --no-backward --html " \
           "diagnosis.html`" in (tmp_path / "plain.md").read_text()
    assert main([*command, "--html", "page.html", "--summary", "with_html.md"]) == 1
    summary = (tmp_path / "with_html.md").read_text()
    assert "Next:" not in summary and "Full report: `page.html`" in summary
    capsys.readouterr()
