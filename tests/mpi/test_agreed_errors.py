"""Input errors that only some ranks see stop every rank together, with the message."""
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from mpi4py import MPI

from minidist.data import default_corpus
from minidist.lessons import common
from minidist.cli import InputError

pytestmark = pytest.mark.mpi


def test_a_data_file_missing_on_one_rank_stops_every_rank():
    comm = MPI.COMM_WORLD
    folder = Path(tempfile.mkdtemp(prefix=f"minidist-rank{comm.Get_rank()}-"))  # this rank's own
    path = folder / "corpus.txt"
    if comm.Get_rank() == 0:
        path.write_text(default_corpus()[:5000])
    args = SimpleNamespace(data=str(path), block_size=8, seed=0)
    if comm.Get_size() == 1:
        assert common.load_dataset(args, comm) is not None
        shutil.rmtree(folder)
        return
    with pytest.raises(InputError) as e:
        common.load_dataset(args, comm)
    expected = "found on another rank" if comm.Get_rank() == 0 else "no such file"
    assert expected in str(e.value)
    shutil.rmtree(folder)
