/*
 * cli/bandwidth.h — the host's memory bandwidth, measured: llmem-bench's probes around its runs
 * and llmem plan's decode estimate.
 */
#ifndef LLMEM_CLI_BANDWIDTH_H
#define LLMEM_CLI_BANDWIDTH_H

#include <stdint.h>

struct llmem_mem;
struct llmem_pool;

/* Appends `passes` read and copy bandwidth measurements (GB/s) to read_gbps / copy_gbps (NULL:
 * no copies), with a multithreaded pass over a `bytes` buffer from mem (tag scratch; NULL:
 * malloc); tick (optional) is called after every pass. CLI_FAIL when the buffer cannot be
 * allocated. */
int cli_bandwidth(struct llmem_mem *mem, struct llmem_pool *pool, int64_t bytes, int passes,
                  double *read_gbps, double *copy_gbps, void (*tick)(void *), void *tick_arg);
/* The read bandwidth (GB/s) of `threads` threads over a `bytes` buffer: the better of two passes
 * after a warm-up, on a pool of its own. */
int cli_read_bandwidth(int threads, int64_t bytes, double *read_gbps);

#endif
