/*
 * kv/codebook.c — tq's value codebook (plan/kv_codebook.h) as the array that the host's codec
 * (codec.c) and the vector kernels (codec_avx2.c, codec_avx512.c) read: the Lloyd–Max quantizer
 * of N(0, 1) with 8 levels, ascending. It lives in a file of its own, below both, so that the
 * kernels call into nothing above them: codec.c → codec_simd.c → codec_avx2.c, codec_avx512.c →
 * codebook.c.
 */
#include "kv/codec_internal.h"
#include "plan/kv_codebook.h"

const float llmem_kv_tq_centroids[8] = LLMEM_KV_TQ_CENTROIDS;
