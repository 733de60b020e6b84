/*
 * model/rope.c — rotary inverse frequencies, computed as transformers computes them (f32 math), so
 * that positions rotate by the same angles as the reference: default, linear and llama3 scaling.
 *
 * transformers keeps these frequencies in a floating-point buffer of the module, so a model cast
 * with `model.to(torch.bfloat16)` (or f16) rotates by frequencies rounded to that dtype, and angles
 * drift from the f32 ones in proportion to the position. `round_to` reproduces that when asked
 * (LLMEM_ROPE_FREQ=checkpoint at load); the default is the exact f32 frequencies that a model
 * loaded with from_pretrained uses.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "model/model_int.h"
#include "llmem/config.h"
#include "llmem/dtype.h"

void llmem_rope_inv_freq(const struct llmem_model_config *cfg, enum llmem_dtype round_to,
                         float *inv_freq) {
    const int64_t dim = cfg->geom.head_dim;
    const float base = (float)cfg->rope_theta;
    const float factor = (float)cfg->rope_factor;
    for (int64_t i = 0; i < dim / 2; i++) {
        float exponent = (float)(2 * i) / (float)dim;
        inv_freq[i] = 1.0f / powf(base, exponent);
    }
    if (strcmp(cfg->rope_type, "linear") == 0) {
        for (int64_t i = 0; i < dim / 2; i++)
            inv_freq[i] /= factor;
    } else if (strcmp(cfg->rope_type, "llama3") == 0) {
        const float low = (float)cfg->rope_low_freq_factor,
                    high = (float)cfg->rope_high_freq_factor;
        const float old_context = (float)cfg->rope_original_max_context;
        const float low_wavelen = old_context / low, high_wavelen = old_context / high;
        for (int64_t i = 0; i < dim / 2; i++) {
            float f = inv_freq[i];
            float wavelen = 2.0f * (float)M_PI / f;
            float scaled = wavelen > low_wavelen ? f / factor : f;
            if (!(wavelen < high_wavelen) && !(wavelen > low_wavelen)) {
                float smooth = (old_context / wavelen - low) / (high - low);
                scaled = (1.0f - smooth) * scaled / factor + smooth * scaled;
            }
            inv_freq[i] = scaled;
        }
    }
    for (int64_t i = 0; i < dim / 2; i++) {
        if (round_to == LLMEM_DTYPE_F16) {
            inv_freq[i] = (float)(_Float16)inv_freq[i];
        } else if (round_to == LLMEM_DTYPE_BF16) {
            uint32_t b;
            memcpy(&b, &inv_freq[i], 4);
            b = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u; /* round to nearest even */
            memcpy(&inv_freq[i], &b, 4);
        }
    }
}
