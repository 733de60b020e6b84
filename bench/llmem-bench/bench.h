/*
 * bench/llmem-bench/bench.h — `llmem-bench`, the benchmark program: one file per benchmark over
 * the helpers of the command-line programs (cli/common.h), and what the benchmarks share: the
 * clock, the median, and the device's bandwidth probe (bw.c; the host's is cli/bandwidth.h).
 *
 * Every benchmark reports medians of repeated runs and ratios measured side by side in one run
 * (absolute numbers are only as good as a quiet machine). With --json, stdout is exactly one JSON
 * object; progress and notes go to stderr.
 */
#ifndef LLMEM_BENCH_H
#define LLMEM_BENCH_H

#include <stdint.h>

/* The benchmarks, `llmem-bench <name> [options]` with argv[0] the name. */
/* `llmem-bench mem` (mem.c): the caching allocator against malloc and mmap. */
int bench_mem(int argc, char **argv);
/* `llmem-bench kv` (kv.c): attention over the KV caches, format accuracy, append cost. */
int bench_kv(int argc, char **argv);
/* `llmem-bench attn` (attn.c): paged decode attention on a GPU. */
int bench_attn(int argc, char **argv);
/* `llmem-bench matmul` (matmul.c): the CPU matmul against the bandwidth and the FMA peak. */
int bench_matmul(int argc, char **argv);
/* `llmem-bench qmatmul` (qmatmul.c): a backend's matmul with quantized weights. */
int bench_qmatmul(int argc, char **argv);
/* `llmem-bench decode MODEL` (decode.c): prefill and decode speed against the bandwidth. */
int bench_decode(int argc, char **argv);
/* `llmem-bench bank MODEL` (bank.c): time to first token with the session bank. */
int bench_bank(int argc, char **argv);
/* `llmem-bench serve MODEL` (serve.c): the HTTP server under concurrent clients. */
int bench_serve(int argc, char **argv);
/* `llmem-bench grammar MODEL` (grammar.c): constrained decoding's masks on a vocabulary. */
int bench_grammar(int argc, char **argv);

/* The median of n values (sorted in place) (main.c). */
double bench_median(double *v, int n);

/* The device-to-device copy bandwidth of CUDA device `device` (bytes read + written per second,
 * the best of 10 copies of `bytes` after a warm-up): the roofline's bandwidth (SPEC §8). */
int bench_device_copy_bandwidth(int device, int64_t bytes, double *copy_gbps);
/* The same probe kept open between runs: its buffers stay allocated, so that runs timed between
 * two probes do not pay for freeing and mapping them again (the device's page tables). */
struct bench_device_probe;
int bench_device_probe_open(int device, int64_t bytes, struct bench_device_probe **out);
int bench_device_probe_run(struct bench_device_probe *p, double *copy_gbps);
void bench_device_probe_close(struct bench_device_probe *p);

#endif
