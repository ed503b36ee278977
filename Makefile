# minidist: `make demo` runs the lessons, `make test` runs every test, `make bench` the benchmarks.
# Both build .venv (the package, mpi4py and the mpich wheel: no system MPI needed) when it is
# missing or older than setup.cfg / pyproject.toml. On a cluster, use its own MPI:
#   make test MPIRUN=mpirun PY=python   (after `pip install -e '.[test]'` without the mpich extra)

PYTHON ?= python3
VENV   := .venv
PY     ?= $(VENV)/bin/python
MPIRUN ?= $(VENV)/bin/mpirun
STAMP  := $(VENV)/.installed
# One BLAS thread per rank: eight ranks on two cores, each with a full thread pool,
# run several times slower than with one thread each.
export OMP_NUM_THREADS=1
export OPENBLAS_NUM_THREADS=1
export MKL_NUM_THREADS=1
MPI_SIZES ?= 1 2 3 4 8

.PHONY: demo test bench venv clean

# With PY given on the command line (a cluster's own Python and MPI), use it as it is:
# no .venv, no mpich wheel.
ifeq ($(origin PY),command line)
SETUP :=
else
SETUP := $(STAMP)
endif

venv: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -e '.[mpich,test]'
	touch $(STAMP)

demo: $(SETUP)
	$(PY) -m minidist.lessons.00_single_process
	$(MPIRUN) -n 4 $(PY) -m minidist.lessons.01_collectives
	$(MPIRUN) -n 4 $(PY) -m minidist.lessons.02_data_parallel
	$(MPIRUN) -n 8 $(PY) -m minidist.lessons.03_tensor_parallel
	$(MPIRUN) -n 4 $(PY) -m minidist.lessons.04_pipeline_parallel
	$(MPIRUN) -n 4 $(PY) -m minidist.lessons.05_zero --stage all
	$(MPIRUN) -n 4 $(PY) -m minidist.lessons.06_fsdp
	$(MPIRUN) -n 8 $(PY) -m minidist.lessons.07_3d_parallel --tp 2 --pp 2 --dp 2
	$(MPIRUN) -n 2 $(PY) -m minidist.lessons.08_activation_recompute --tp 2

test: $(SETUP)
	$(PY) -m pytest -q tests
	@for n in $(MPI_SIZES); do \
	  echo "== MPI tests on $$n ranks"; \
	  $(MPIRUN) -n $$n $(PY) -m pytest -q --only-mpi tests/mpi || exit 1; \
	done

bench: $(SETUP)
	$(PY) -m minidist.bench model
	$(MPIRUN) -n 4 $(PY) -m minidist.bench collectives

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
