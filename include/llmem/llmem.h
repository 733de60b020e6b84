/*
 * llmem/llmem.h — the whole public API of libllmem in one include.
 *
 * Build against it with `pkg-config --cflags --libs llmem`. Only the functions these headers
 * declare (marked LLMEM_API) leave the library; everything else is internal.
 */
#ifndef LLMEM_H
#define LLMEM_H

#include "llmem/api.h"
#include "llmem/status.h"
#include "llmem/size.h"
#include "llmem/sys.h"
#include "llmem/plan.h"
#include "llmem/mem.h"
#include "llmem/pool.h"
#include "llmem/dtype.h"
#include "llmem/safetensors.h"
#include "llmem/config.h"
#include "llmem/backend.h"
#include "llmem/kv.h"
#include "llmem/model.h"
#include "llmem/forward.h"
#include "llmem/tokenizer.h"
#include "llmem/grammar.h"
#include "llmem/sampler.h"
#include "llmem/guard.h"
#include "llmem/bank.h"
#include "llmem/spill.h"
#include "llmem/engine.h"
#include "llmem/server.h"

#endif
