# moe - distributed Mixture-of-Experts service.
#   make            build everything (CUDA sources too when nvcc is present)
#   make run        install missing deps, build, start a local cluster, run a demo
#   make test       install missing deps, build, run the Criterion suite (no GPU)
#   make check-gpu  CUDA kernels against the CPU reference (GPU machine; tests/gpu/)
#   make check-gpu-dataplane  CUDA IPC and the Python client against a GPU worker (GPU machine)
#   make NO_CUDA=1  skip CUDA sources
#   make lint / make format
#   make install [PREFIX=/usr/local] [DESTDIR=]  binaries, library, header, systemd units, docs
#   make bundle     a tarball for air-gapped hosts (build/moe-bundle-*.tar.gz; docs/OPERATIONS.md)

CC      ?= gcc
NVCC    ?= $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
CUDA_HOME ?= /usr/local/cuda
# Extra include/lib dirs for an offline dependency bundle (see docs/OPERATIONS.md).
DEPS_PREFIX ?=

OPT     ?= -O2
CFLAGS  += $(OPT) -g -std=c11 -D_GNU_SOURCE -Wall -Wextra -Wno-unused-parameter -Wno-format-truncation -fno-math-errno -fvect-cost-model=cheap -fPIC \
           -fvisibility=hidden -MMD -MP \
           -I. -I/usr/include/x86_64-linux-gnu/openblas-pthread
LDLIBS  += -lnng -luv -lmsgpackc -lopenblas -lm -lpthread
# whole programs built in one step (bench/): no dependency files next to them
CFLAGS_PROG = $(filter-out -MMD -MP,$(CFLAGS))
# WERROR=1 (CI): a warning fails the build
ifeq ($(WERROR),1)
CFLAGS  += -Werror
endif
ifneq ($(DEPS_PREFIX),)
CFLAGS  += -I$(DEPS_PREFIX)/usr/include
LDFLAGS += -L$(DEPS_PREFIX)/usr/lib/x86_64-linux-gnu -Wl,-rpath-link,$(DEPS_PREFIX)/usr/lib/x86_64-linux-gnu \
           -Wl,-rpath,$(DEPS_PREFIX)/usr/lib/x86_64-linux-gnu
endif

ifeq ($(NO_CUDA),)
ifneq ($(NVCC),)
HAVE_CUDA := 1
endif
endif

B := build
BASE_SRC   := $(wildcard base/*.c)
COMMON_SRC := $(wildcard common/*.c)
PROTO_SRC  := $(wildcard proto/*.c)
KERN_SRC   := $(wildcard kernels/*.c)
RPC_SRC    := $(wildcard rpc/*.c)
SERVER_SRC := $(filter-out server/main.c,$(wildcard server/*.c))
WORKER_SRC := $(filter-out worker/main.c,$(wildcard worker/*.c))
CLIENT_SRC := $(filter-out client/moectl.c,$(wildcard client/*.c))
# the checks (tests/README.md): unit/ (pure functions, kernels, proto),
# cluster/ (real daemons, started by tests/cluster.{h,c}), faults/ (under
# worker kills), all in one Criterion binary; gpu/ holds the GPU programs
TEST_SRC   := $(wildcard tests/*.c tests/unit/*.c tests/cluster/*.c tests/faults/*.c)
CUDA_SRC   := $(wildcard kernels/cuda/*.cu kernels/cuda/gemm/*.cu)

obj = $(patsubst %.c,$(B)/%.o,$(1))
CORE_LIB   := $(B)/libmoecore.a
KERN_LIB   := $(B)/libmoekern.a
RPC_LIB    := $(B)/libmoerpc.a
SERVER_LIB := $(B)/libmoeserver.a
WORKER_LIB := $(B)/libmoeworker.a
CUDA_LIB   := $(B)/libmoekern_cuda.a

ifeq ($(HAVE_CUDA),1)
# Two kernel images: sm_90a (Hopper: wgmma, TMA, clusters) and the portable
# one, sm_80 code plus compute_80 PTX that the driver compiles for newer GPUs
# (mma.sync GEMMs); kernels/cuda/kcu_arch.cu picks at run time.
NVCC_GENCODE ?= -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_80,code=sm_80 \
                -gencode=arch=compute_80,code=compute_80
NVCCFLAGS ?= -O3 -std=c++17 $(NVCC_GENCODE) -Xcompiler -fPIC \
             -I.
CUDA_OBJS  := $(patsubst %.cu,$(B)/%.o,$(CUDA_SRC))
CUDA_LINK  := $(CUDA_LIB) -L$(CUDA_HOME)/lib64 -lnccl -lcudart_static -ldl -lrt -lstdc++
CFLAGS     += -DMOE_HAVE_CUDA=1 -I$(CUDA_HOME)/include
# libmoe's NCCL path (client/client_nccl.c) finds the CUDA runtime and NCCL
# at run time (client/cuda_dl.c): libmoe links no GPU library
CLIENT_CUDA_LINK := -ldl
endif

BINS := bin/moe-coordinator bin/moe-worker bin/moectl
LIBS := lib/libmoe.a lib/libmoe.so

.PHONY: all deps run test install bundle check-gpu check-gpu-portable check-gpu-dataplane bench lint format clean fuzz
# `all` is declared once, at the end, from ALL_TARGETS
.DEFAULT_GOAL := all
ALL_TARGETS := $(BINS) $(LIBS) $(B)/moe-tests

# header dependencies come from the compiler (-MMD -MP: build/**/*.d)
$(B)/%.o: %.c Makefile
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@
-include $(shell find $(B) -name '*.d' 2>/dev/null)

$(B)/%.o: %.cu $(wildcard kernels/*.h kernels/cuda/*.h kernels/cuda/*.cuh kernels/cuda/gemm/*.cuh)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -c $< -o $@

$(CORE_LIB): $(call obj,$(BASE_SRC) $(COMMON_SRC) $(PROTO_SRC))
	@mkdir -p $(dir $@); rm -f $@; ar rcs $@ $^
$(KERN_LIB): $(call obj,$(KERN_SRC))
	@mkdir -p $(dir $@); rm -f $@; ar rcs $@ $^
$(RPC_LIB): $(call obj,$(RPC_SRC))
	@mkdir -p $(dir $@); rm -f $@; ar rcs $@ $^
$(SERVER_LIB): $(call obj,$(SERVER_SRC))
	@mkdir -p $(dir $@); rm -f $@; ar rcs $@ $^
$(WORKER_LIB): $(call obj,$(WORKER_SRC))
	@mkdir -p $(dir $@); rm -f $@; ar rcs $@ $^
$(CUDA_LIB): $(CUDA_OBJS)
	@mkdir -p $(dir $@); rm -f $@; ar rcs $@ $^

bin/moe-coordinator: $(B)/server/main.o $(SERVER_LIB) $(RPC_LIB) lib/libmoe.a $(CORE_LIB)
	@mkdir -p bin
	$(CC) $(LDFLAGS) -o $@ $^ $(CLIENT_CUDA_LINK) $(LDLIBS)
bin/moe-worker: $(B)/worker/main.o $(WORKER_LIB) $(RPC_LIB) lib/libmoe.a $(KERN_LIB) $(CORE_LIB) $(if $(HAVE_CUDA),$(CUDA_LIB))
	@mkdir -p bin
	$(CC) $(LDFLAGS) -o $@ $(filter %.o,$^) $(WORKER_LIB) $(RPC_LIB) $(KERN_LIB) lib/libmoe.a $(CORE_LIB) $(CUDA_LINK) $(LDLIBS)
lib/libmoe.a: $(call obj,$(CLIENT_SRC) $(BASE_SRC) $(COMMON_SRC) $(PROTO_SRC))
	@mkdir -p lib; rm -f $@; ar rcs $@ $^
lib/libmoe.so: $(call obj,$(CLIENT_SRC) $(BASE_SRC) $(COMMON_SRC) $(PROTO_SRC))
	@mkdir -p lib
	$(CC) -shared $(LDFLAGS) -o $@ $^ $(CLIENT_CUDA_LINK) -lnng -lpthread -lm
# moectl is a client of libmoe and nothing else (bf16 and test inputs from
# the floors below the kernels: base/, common/)
bin/moectl: $(B)/client/moectl.o lib/libmoe.a
	@mkdir -p bin
	$(CC) $(LDFLAGS) -o $@ $^ $(CLIENT_CUDA_LINK) -lnng -lm -lpthread

# One Criterion binary holds every test: one Synthesis line at the end.
$(B)/moe-tests: $(call obj,$(TEST_SRC)) $(SERVER_LIB) $(WORKER_LIB) $(RPC_LIB) $(KERN_LIB) lib/libmoe.a $(CORE_LIB) $(if $(HAVE_CUDA),$(CUDA_LIB))
	$(CC) $(LDFLAGS) -o $@ $(call obj,$(TEST_SRC)) $(SERVER_LIB) $(WORKER_LIB) $(RPC_LIB) $(KERN_LIB) \
	    lib/libmoe.a $(CORE_LIB) $(CUDA_LINK) -lcriterion $(LDLIBS)

deps:
	@MOE_CUDA=$(if $(HAVE_CUDA),1,0) bash deploy/install-deps.sh

test: deps
	@$(MAKE) --no-print-directory all
	@($(B)/moe-tests --color=never -j2 $(TEST_ARGS); echo $$? > $(B)/test.rc) 2>&1 | tee $(B)/test.log
	@st=$$(cat $(B)/test.rc); if [ "$$st" != 0 ]; then \
	    echo "== the failed tests (whole log: $(B)/test.log) =="; \
	    grep -E -A3 '^\[----\] [^ ]+:[0-9]+: |^\[FAIL\]' $(B)/test.log | tail -80; fi; exit $$st

# install: what deploy/install.sh lays out (docs/OPERATIONS.md, "systemd")
PREFIX ?= /usr/local
DESTDIR ?=
install: $(BINS) $(LIBS)
	PREFIX='$(PREFIX)' DESTDIR='$(DESTDIR)' bash deploy/install.sh

# bundle: binaries, library, runtime .debs, NCCL, the Python wheel(s) and
# deploy/install-bundle.sh in one tarball (deploy/bundle.sh)
bundle: $(BINS) $(LIBS)
	bash deploy/bundle.sh --out $(B)

run: deps
	@$(MAKE) --no-print-directory all
	@bash deploy/run-local.sh

ifeq ($(HAVE_CUDA),1)
# check-gpu and moe_bench link no OpenBLAS, nng or libuv (absent on the GPU
# machine): the CPU reference objects plus static cudart (and cuBLAS for bench).
bin/check-gpu: tests/gpu/check_gpu.cu $(CUDA_LIB) $(KERN_LIB) $(CORE_LIB)
	@mkdir -p bin
	$(NVCC) $(NVCCFLAGS) -I/usr/include/x86_64-linux-gnu/openblas-pthread -o $@ $< \
	    $(CUDA_LIB) $(KERN_LIB) $(CORE_LIB) -lm
check-gpu: bin/check-gpu
	./bin/check-gpu
# check-gpu-portable: the same checks on the portable image alone (compute_80
# PTX, compiled by the driver): on a Hopper GPU it runs the kernels an A100,
# L40S or newer GPU without sm_90a code runs (mma.sync GEMMs, no PDL)
bin/check-gpu-portable: tests/gpu/check_gpu.cu $(CUDA_SRC) $(wildcard kernels/cuda/*.cuh kernels/cuda/*.h kernels/cuda/gemm/*.cuh) $(KERN_LIB) $(CORE_LIB)
	@$(MAKE) --no-print-directory B=$(B)/portable NVCC_GENCODE='-gencode=arch=compute_80,code=compute_80' \
	    $(B)/portable/libmoekern_cuda.a
	$(NVCC) -O3 -std=c++17 -gencode=arch=compute_80,code=compute_80 -Xcompiler -fPIC -I. \
	    -I/usr/include/x86_64-linux-gnu/openblas-pthread -o $@ $< \
	    $(B)/portable/libmoekern_cuda.a $(KERN_LIB) $(CORE_LIB) -lm
check-gpu-portable: bin/check-gpu-portable
	./bin/check-gpu-portable
bin/moe_bench: bench/moe_bench.cu $(CUDA_LIB)
	@mkdir -p bin
	$(NVCC) $(NVCCFLAGS) -o $@ $< $(CUDA_LIB) -lcublas -Xlinker -rpath=$(CUDA_HOME)/lib64
# ep_bench: expert parallelism over the GPUs of one host (NCCL, pthreads)
bin/ep_bench: bench/ep_bench.cu $(CUDA_LIB)
	@mkdir -p bin
	$(NVCC) $(NVCCFLAGS) -o $@ $< $(CUDA_LIB) -lnccl -lpthread -ldl
# topk_bench: the router's softmax/top-k on one warp, two versions (kcu_topk.cuh)
bin/topk_bench: bench/topk_bench.cu kernels/cuda/kcu_topk.cuh
	@mkdir -p bin
	$(NVCC) $(NVCCFLAGS) -o $@ $<
# tma_stream: the ceiling of v10's loads (weights by TMA, + rows), no math (sm_90a only)
bin/tma_stream: bench/tma_stream.cu kernels/cuda/kcu_tool.h kernels/cuda/gemm/tma.cuh kernels/cuda/gemm/common.cuh
	@mkdir -p bin
	$(NVCC) -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I. -o $@ $<
bench: bin/moe_bench bin/ep_bench
	./bin/moe_bench
# tests/gpu/xchg_nccl_check: the NCCL exchange backend on this host's GPUs
# (forked ranks; deploy/gpu-smoke.sh runs it on 2+ GPUs)
bin/xchg_nccl_check: tests/gpu/xchg_nccl_check.c $(B)/worker/xchg_nccl.o $(B)/kernels/cuda/kcu_abort.o $(B)/worker/xchg_abort.o $(B)/worker/pool.o $(RPC_LIB) $(CORE_LIB)
	@mkdir -p bin
	$(CC) $(CFLAGS_PROG) $(LDFLAGS) -o $@ $^ -L$(CUDA_HOME)/lib64 -lnccl -lcudart_static -ldl -lrt \
	    -lnng -luv -lmsgpackc -lpthread -lm
ALL_TARGETS += bin/ep_bench bin/topk_bench bin/tma_stream bin/check-gpu bin/xchg_nccl_check bin/moe_bench
endif

FMT_SRC = $(sort $(wildcard */*.c */*.h tests/*/*.c tests/gpu/*.cu kernels/cuda/*.cu kernels/cuda/*.cuh kernels/cuda/gemm/*.cu kernels/cuda/gemm/*.cuh bench/*.c bench/*.cu fuzz/*.c))
format:
	clang-format -i $(FMT_SRC)
# tools/calls.py reads the server's objects (nm): they are built first
lint: $(call obj,$(SERVER_SRC))
	python3 tools/layers.py
	python3 tools/calls.py
	python3 tools/calls.py --self-test
	python3 tools/gen_wgmma_n.py --check
	@# Criterion 2.4 fails the whole run on any warning, even with every test
	@# passing: tests log with cr_log_info
	@! grep -rn --include='*.c' --include='*.h' 'cr_log_warn' tests/ || { echo "lint: cr_log_warn in tests (use cr_log_info)"; exit 1; }
	clang-format --dry-run -Werror $(FMT_SRC)
	cppcheck --quiet --error-exitcode=1 --enable=warning,performance,portability \
	    --suppress=missingIncludeSystem --inline-suppr -D__GNUC__ -I. \
	    base common proto rpc kernels server worker client

clean:
	rm -rf $(B) bin lib

# bench/service_bench: checks and times a running cluster (not a test).
bin/service_bench: bench/service_bench.c $(KERN_LIB) lib/libmoe.a
	@mkdir -p bin
	$(CC) $(CFLAGS_PROG) $(LDFLAGS) -o $@ $^ $(if $(HAVE_CUDA),-L$(CUDA_HOME)/lib64 -lcudart_static -ldl -lrt) \
	    -lnng -lopenblas -lm -lpthread
ALL_TARGETS += bin/service_bench

ifeq ($(HAVE_CUDA),1)
# tests/gpu/cuda_ipc_check: rows on a GPU through the service (GPU host, a second process)
bin/cuda_ipc_check: tests/gpu/cuda_ipc_check.c $(KERN_LIB) lib/libmoe.a
	@mkdir -p bin
	$(CC) $(CFLAGS_PROG) $(LDFLAGS) -o $@ $^ -L$(CUDA_HOME)/lib64 -lcudart_static -ldl -lrt \
	    -lnng -lopenblas -lm -lpthread
ALL_TARGETS += bin/cuda_ipc_check
# check-gpu-dataplane: the data plane on this host's GPU, two processes each
# (a worker and a client): CUDA IPC from C, then the Python client (NumPy,
# torch CPU and CUDA tensors), against a one-GPU cluster each time; with
# two GPUs or more, the fan-out of decode batches on 2 GPU workers
# (tests/gpu/fanout_check.sh)
check-gpu-dataplane: bin/cuda_ipc_check
	deploy/gpu-cluster.sh -w 1 -b cuda -- bin/cuda_ipc_check --no-timing
	deploy/gpu-cluster.sh -w 1 -b cuda -- bash -c 'python3 python/dataplane_check.py --url $$MOE_URL'
	tests/gpu/fanout_check.sh
endif

# bench/cpu_layer_bench: one CPU-worker layer forward, timed (bench/cpu_peer.py; not a test).
bin/cpu_layer_bench: bench/cpu_layer_bench.c $(B)/worker/blas_pick.o $(KERN_LIB) $(CORE_LIB)
	@mkdir -p bin
	$(CC) $(CFLAGS_PROG) $(LDFLAGS) -o $@ $^ -lopenblas -lm -lpthread
ALL_TARGETS += bin/cpu_layer_bench

# fuzz: libFuzzer for FUZZ_SECONDS each (see fuzz/README.md): the wire
# decoder, the params layer, and the coordinator's request handling
FUZZ_SECONDS ?= 60
FUZZ_CC = clang -g -O1 -fsanitize=fuzzer,address,undefined -D_GNU_SOURCE \
          -I.
FUZZ_RUN = UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
COORD_FUZZ_SRC = $(SERVER_SRC) $(RPC_SRC) $(CLIENT_SRC) $(BASE_SRC) $(COMMON_SRC) $(PROTO_SRC)
fuzz:
	@mkdir -p $(B)/fuzz fuzz/corpus-out fuzz/corpus-params-out fuzz/corpus-coord-out
	$(FUZZ_CC) fuzz/fuzz_decode.c $(PROTO_SRC) base/err.c -o $(B)/fuzz/decode
	$(FUZZ_CC) fuzz/fuzz_params.c common/params.c common/model_cfg.c common/act.c \
	    common/hfcfg.c common/json.c $(PROTO_SRC) base/err.c \
	    -o $(B)/fuzz/params
	$(FUZZ_CC) fuzz/fuzz_coord.c $(COORD_FUZZ_SRC) -o $(B)/fuzz/coord -lnng -luv -lpthread -lm
	$(FUZZ_RUN) $(B)/fuzz/decode fuzz/corpus-out fuzz/corpus -max_total_time=$(FUZZ_SECONDS) -max_len=4096
	$(FUZZ_RUN) $(B)/fuzz/params fuzz/corpus-params-out fuzz/corpus-params \
	    -max_total_time=$(FUZZ_SECONDS) -max_len=4096
	cd $(B)/fuzz && $(FUZZ_RUN) ./coord ../../fuzz/corpus-coord-out ../../fuzz/corpus-coord \
	    -max_total_time=$(FUZZ_SECONDS) -max_len=4096 -detect_leaks=0

all: $(ALL_TARGETS)
