"""The one table formatter: columns as wide as their widest cell, so long cells never shear a table."""

import pytest
from click.testing import CliRunner

from sp_plan.cli.main import cli
from sp_plan.cost_models.text_table import Column, format_table


def test_columns_take_the_width_of_their_widest_cell():
    lines = format_table([Column("name"), Column("value", ">")], [["a", "1"], ["a much longer name", "12345.6"]])
    assert lines == ["name                  value",
                     "a                         1",
                     "a much longer name  12345.6"]


def test_short_rows_are_padded_and_long_rows_refused():
    assert format_table([Column("a"), Column("b")], [["x"]], indent="  ") == ["  a  b", "  x"]
    with pytest.raises(ValueError, match="3 cells for 2 columns"):
        format_table([Column("a"), Column("b")], [["x", "y", "z"]])


def test_the_plan_table_stays_aligned_with_long_options():
    """The README's main job: a plan with an offloaded optimizer has longer options than the others, which
    pushed its numbers out of their columns when the widths were fixed guesses."""
    out = CliRunner().invoke(cli, ["plan", "--model", "llama3-70b", "--seq-len", "1M", "--gpus", "64", "--top", "5"])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("#  layout"))
    header, rows = lines[at], lines[at + 1:at + 6]
    assert any("offload optim" in row for row in rows)  # the case whose longer options sheared the table
    for title in ("mem/GPU", "step", "tokens/s", "MFU", "exposed comm"):  # right-aligned: figures end under titles
        end = header.index(title) + len(title)
        assert all(row[end - 1] != " " and row[end:end + 1] in ("", " ") for row in rows), title
