/*
 * cli/plan_svg.c — the plan's envelope as a picture: one stacked bar (weights | KV reserve |
 * transients | session bank | headroom) on a scale from 0 to the machine's memory, with the
 * allocation limit, the trip and the ceiling marked, and a legend with every size.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "cli/cli.h"
#include "llmem/plan.h"
#include "llmem/size.h"

#define W     960
#define BAR_X 40
#define BAR_W 880
#define BAR_Y 132
#define BAR_H 56
#define WRAP  125 /* characters per line of the describe text */

struct segment {
    const char *name;
    int64_t bytes;
    const char *fill;
};

static void xml_text(FILE *f, const char *s) {
    for (; *s; s++) {
        switch (*s) {
        case '<': fputs("&lt;", f); break;
        case '>': fputs("&gt;", f); break;
        case '&': fputs("&amp;", f); break;
        case '"': fputs("&quot;", f); break;
        default: fputc(*s, f);
        }
    }
}

static double x_of(int64_t bytes, int64_t scale) {
    return BAR_X + (double)BAR_W * (double)bytes / (double)scale;
}

/* A vertical line through the bar with its label in its own row above it. */
static void marker(FILE *f, const char *name, int64_t bytes, int64_t scale, const char *color,
                   int row) {
    char s[LLMEM_SIZE_STR_MAX];
    double x = x_of(bytes, scale);
    int label_y = BAR_Y - 10 - 16 * row;
    /* The allocation limit reads leftwards and the trip rightwards, so that neither label is
     * crossed by the other's line; any label near an edge turns inwards. */
    const char *anchor = row == 0 ? "end" : row == 1 ? "start" : "middle";
    if (x > W - 180)
        anchor = "end";
    else if (x < BAR_X + 180)
        anchor = "start";
    fprintf(f, "<line x1='%.1f' y1='%d' x2='%.1f' y2='%d' stroke='%s' stroke-width='2'%s/>\n", x,
            label_y + 4, x, BAR_Y + BAR_H + 8, color, row == 0 ? "" : " stroke-dasharray='5,3'");
    fprintf(f, "<text x='%.1f' y='%d' fill='%s' font-size='12' text-anchor='%s'>%s %s</text>\n",
            x + (anchor[0] == 'e'   ? -4
                 : anchor[0] == 's' ? 4
                                    : 0),
            label_y, color, anchor, name, llmem_size_format_short(bytes, s, sizeof(s)));
}

/* The describe line, wrapped at spaces into lines of at most WRAP characters. */
static int wrapped_text(FILE *f, const char *text, int x, int y) {
    char line[WRAP + 1];
    int lines = 0;
    while (*text) {
        size_t n = strlen(text);
        if (n > WRAP) {
            n = WRAP;
            while (n > 0 && text[n] != ' ')
                n--;
            if (n == 0)
                n = WRAP;
        }
        memcpy(line, text, n);
        line[n] = '\0';
        fprintf(f, "<text x='%d' y='%d' font-size='12' fill='#444'>", x, y + 16 * lines++);
        xml_text(f, line);
        fprintf(f, "</text>\n");
        text += n;
        while (*text == ' ')
            text++;
    }
    return lines;
}

int cli_plan_svg(const struct llmem_plan *p, const char *path) {
    FILE *f = fopen(path, "w");
    if (f == NULL) {
        fprintf(stderr, "llmem plan: --svg %s: %s\n", path, strerror(errno));
        return CLI_FAIL;
    }
    const struct segment segs[] = {
        {"weights", p->weights_bytes, "#4e79a7"},
        {"runtime baseline", p->runtime_baseline_bytes, "#9c755f"},
        {"KV reserve", p->kv_reserve_bytes, "#f28e2b"},
        {"transients", p->runtime_transients_bytes, "#b07aa1"},
        {"session bank", p->bank_steady_bytes, "#59a14f"},
        {"headroom", p->headroom_bytes, "#bab0ac"},
    };
    const int n = (int)(sizeof(segs) / sizeof(segs[0]));
    int64_t sum = 0;
    for (int i = 0; i < n; i++)
        sum += p->available ? segs[i].bytes : 0;
    int64_t scale = p->total_bytes;
    if (p->ceiling_bytes > scale)
        scale = p->ceiling_bytes;
    if (p->trip_bytes > scale)
        scale = p->trip_bytes;
    if (sum > scale)
        scale = sum;
    if (scale <= 0)
        scale = 1;

    char line[512], s[LLMEM_SIZE_STR_MAX];
    int height = 330;
    fprintf(f,
            "<svg xmlns='http://www.w3.org/2000/svg' width='%d' height='%d' viewBox='0 0 %d %d'"
            " font-family='DejaVu Sans, Helvetica, Arial, sans-serif'>\n",
            W, height, W, height);
    fprintf(f, "<rect width='100%%' height='100%%' fill='#ffffff'/>\n");
    fprintf(f, "<text x='%d' y='24' font-size='15' font-weight='bold' fill='#222'>", BAR_X);
    xml_text(f, p->available ? "llmem memory plan" : "llmem memory plan — unavailable");
    fprintf(f, "</text>\n");
    wrapped_text(f, llmem_plan_describe(p, line, sizeof(line)), BAR_X, 46);

    /* The machine: an outline from 0 to the total. */
    fprintf(f, "<rect x='%d' y='%d' width='%.1f' height='%d' fill='#f4f4f4' stroke='#999'/>\n",
            BAR_X, BAR_Y, x_of(p->total_bytes, scale) - BAR_X, BAR_H);
    double x = BAR_X;
    for (int i = 0; p->available && i < n; i++) {
        double w = (double)BAR_W * (double)segs[i].bytes / (double)scale;
        if (w <= 0)
            continue;
        fprintf(f,
                "<rect x='%.1f' y='%d' width='%.1f' height='%d' fill='%s'>"
                "<title>%s %s</title></rect>\n",
                x, BAR_Y, w, BAR_H, segs[i].fill, segs[i].name,
                llmem_size_format_short(segs[i].bytes, s, sizeof(s)));
        if (w > 70)
            fprintf(f,
                    "<text x='%.1f' y='%d' font-size='12' fill='#fff' text-anchor='middle'>"
                    "%s</text>\n",
                    x + w / 2, BAR_Y + BAR_H / 2 + 4,
                    llmem_size_format_short(segs[i].bytes, s, sizeof(s)));
        x += w;
    }
    if (p->available) {
        marker(f, "allocation limit", p->allocation_limit_bytes, scale, "#1f3b73", 0);
        marker(f, "trip", p->trip_bytes, scale, "#c0392b", 1);
        marker(f, "ceiling", p->ceiling_bytes, scale, "#000000", 2);
    }
    if (p->available && sum > p->total_bytes)
        fprintf(f,
                "<text x='%d' y='%d' font-size='12' fill='#c0392b' text-anchor='end'>"
                "needs %s: %s more than the machine has</text>\n",
                BAR_X + BAR_W, BAR_Y + BAR_H + 22, llmem_size_format_short(sum, s, sizeof(s)),
                llmem_size_format_short(sum - p->total_bytes, line, sizeof(line)));
    /* Scale ticks under the bar. */
    fprintf(f, "<text x='%d' y='%d' font-size='11' fill='#666'>0</text>\n", BAR_X,
            BAR_Y + BAR_H + 22);
    fprintf(f,
            "<text x='%.1f' y='%d' font-size='11' fill='#666' text-anchor='end'>"
            "memory %s</text>\n",
            x_of(p->total_bytes, scale), BAR_Y + BAR_H + 22,
            llmem_size_format_short(p->total_bytes, s, sizeof(s)));

    /* Legend. */
    int ly = BAR_Y + BAR_H + 52;
    for (int i = 0; i < n; i++) {
        int lx = BAR_X + (i % 3) * 300, row = ly + (i / 3) * 22;
        fprintf(f, "<rect x='%d' y='%d' width='14' height='14' fill='%s'/>\n", lx, row - 11,
                segs[i].fill);
        fprintf(f, "<text x='%d' y='%d' font-size='12.5' fill='#222'>%s %s</text>\n", lx + 20, row,
                segs[i].name, llmem_size_format_short(segs[i].bytes, s, sizeof(s)));
    }
    fprintf(f,
            "<text x='%d' y='%d' font-size='12' fill='#444'>context %lld tokens, KV %s"
            ", util %.3f (band %.3f–%.3f)%s</text>\n",
            BAR_X, ly + 56, (long long)p->context_window_resolved,
            llmem_kv_format_name(p->kv_format), p->util, p->band_low, p->band_high,
            p->band_empty ? ", band EMPTY" : "");
    fprintf(f, "</svg>\n");
    if (fclose(f) != 0) {
        fprintf(stderr, "llmem plan: --svg %s: %s\n", path, strerror(errno));
        return CLI_FAIL;
    }
    return CLI_OK;
}
