/*
 * model/rope.c — rotary inverse frequencies, computed as transformers computes them (f32 math), so
 * that positions rotate by the same angles as the reference: default, linear and llama3 scaling.
 * They stay in f32 whatever the checkpoint's dtype, as in a model loaded with from_pretrained.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "model/model_int.h"
#include "llmem/config.h"
#include "llmem/dtype.h"

void llmem_rope_inv_freq(const struct llmem_model_config *cfg, float *inv_freq) {
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
}
