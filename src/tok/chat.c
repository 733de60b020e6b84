/*
 * tok/chat.c — chat templates: recognized by their markers, rendered by C.
 *
 * The Jinja text of a model's template is never interpreted. It is matched to a family
 * (<|im_start|> → ChatML, <|start_header_id|> → Llama 3, [INST] → Mistral) and the family is
 * rendered here, byte for byte as the Hugging Face templates render plain conversations (no
 * tools):
 *  - ChatML (Qwen2.5-Instruct and generic ChatML): "<|im_start|>{role}\n{content}<|im_end|>\n"
 *    per message, "<|im_start|>assistant\n" as the generation prompt. When the model's own
 *    template carries Qwen2.5's default system prompt ("You are Qwen, created by Alibaba Cloud.
 *    You are a helpful assistant.") and the first message is not a system message, that system
 *    message is inserted first, as Qwen2.5's template does; generic ChatML inserts nothing.
 *  - Llama 3 (Meta-Llama-3-Instruct): BOS, then per message
 *    "<|start_header_id|>{role}<|end_header_id|>\n\n{content, trimmed}<|eot_id|>", and
 *    "<|start_header_id|>assistant<|end_header_id|>\n\n" as the generation prompt. (Llama 3.1's
 *    template adds a "Cutting Knowledge Date" system header; the 3.0 form is rendered.)
 *  - Mistral: BOS, then "[INST] {user} [/INST]" and "{assistant}</s>" alternating, user first; a
 *    leading system message is put before the first user message, separated by a blank line
 *    (Mistral-7B-Instruct-v0.2, and the form used without a template). The spacing of the other
 *    published variants is read from the template's text: v0.1's " [INST] u [/INST] a</s>", and
 *    v0.3's "[INST] u[/INST] a</s>" with the system message on the last user turn. The template
 *    has no generation prompt.
 */
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "tok/tok_int.h"

static const char QWEN_DEFAULT_SYSTEM[] =
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.";

static const char *const names[] = {"none", "chatml", "llama3", "mistral"};

const char *llmem_chat_template_name(enum llmem_chat_template t) {
    return (unsigned)t < sizeof(names) / sizeof(names[0]) ? names[t] : "unknown";
}

int llmem_chat_template_parse(const char *name, enum llmem_chat_template *t) {
    LLMEM_ASSERT(name != NULL && t != NULL);
    for (int i = LLMEM_CHAT_CHATML; i <= LLMEM_CHAT_MISTRAL; i++) {
        if (strcmp(name, names[i]) == 0) {
            *t = (enum llmem_chat_template)i;
            return LLMEM_OK;
        }
    }
    LLMEM_ERROR("unknown chat template '%s' (chatml, llama3 or mistral)", name);
    return LLMEM_EINVAL;
}

int llmem_tokenizer_chat_template(const struct llmem_tokenizer *tok, enum llmem_chat_template *t) {
    LLMEM_ASSERT(tok != NULL && t != NULL);
    const char *s = tok->chat_template;
    *t = LLMEM_CHAT_NONE;
    if (s == NULL)
        return LLMEM_OK;
    if (strstr(s, "<|im_start|>") != NULL)
        *t = LLMEM_CHAT_CHATML;
    else if (strstr(s, "<|start_header_id|>") != NULL)
        *t = LLMEM_CHAT_LLAMA3;
    else if (strstr(s, "[INST]") != NULL)
        *t = LLMEM_CHAT_MISTRAL;
    else {
        LLMEM_ERROR("unrecognized chat template; pass --chat-template chatml|llama3|mistral");
        return LLMEM_EUNSUPPORTED;
    }
    return LLMEM_OK;
}

/* ---- rendering ------------------------------------------------------------------------------ */

static int add(struct tok_buf *b, const char *s) {
    return llmem_tok_buf_add(b, s, strlen(s));
}

static int is_ws(char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

/* A message's content, NULs included. */
static size_t content_len(const struct llmem_chat_message *m) {
    return m->content_len > 0 ? m->content_len : strlen(m->content);
}

static int add_content(struct tok_buf *b, const struct llmem_chat_message *m) {
    return llmem_tok_buf_add(b, m->content, content_len(m));
}

/* Jinja's trim: the content without leading and trailing whitespace. */
static int add_trimmed(struct tok_buf *b, const struct llmem_chat_message *m) {
    const char *s = m->content;
    size_t n = content_len(m), i = 0;
    while (i < n && is_ws(s[i]))
        i++;
    while (n > i && is_ws(s[n - 1]))
        n--;
    return llmem_tok_buf_add(b, s + i, n - i);
}

/* Mistral's tool turns, written as they come and outside the user/assistant alternation: the
 * tools before a user message, an assistant's calls (then the EOS), a tool's results. */
static int mistral_tool_role(const char *role) {
    return strcmp(role, "available_tools") == 0 || strcmp(role, "tool_calls") == 0 ||
           strcmp(role, "tool_results") == 0;
}

/* system, user and assistant; Llama 3's ipython too (a tool's result, as 3.1's template writes
 * it), and Mistral's tool turns. */
static int known_role(const char *role, enum llmem_chat_template t) {
    return strcmp(role, "system") == 0 || strcmp(role, "user") == 0 ||
           strcmp(role, "assistant") == 0 ||
           (t == LLMEM_CHAT_LLAMA3 && strcmp(role, "ipython") == 0) ||
           (t == LLMEM_CHAT_MISTRAL && mistral_tool_role(role));
}

static int render_chatml(const struct llmem_tokenizer *tok, const struct llmem_chat_message *m,
                         int n, int gen, struct tok_buf *b) {
    int st = LLMEM_OK;
    if (tok->chat_template != NULL && strstr(tok->chat_template, QWEN_DEFAULT_SYSTEM) != NULL &&
        (n == 0 || strcmp(m[0].role, "system") != 0)) {
        st |= add(b, "<|im_start|>system\n");
        st |= add(b, QWEN_DEFAULT_SYSTEM);
        st |= add(b, "<|im_end|>\n");
    }
    for (int i = 0; i < n; i++) {
        st |= add(b, "<|im_start|>");
        st |= add(b, m[i].role);
        st |= add(b, "\n");
        st |= add_content(b, &m[i]);
        st |= add(b, "<|im_end|>\n");
    }
    if (gen)
        st |= add(b, "<|im_start|>assistant\n");
    return st ? LLMEM_ENOMEM : LLMEM_OK;
}

static int render_llama3(const struct llmem_tokenizer *tok, const struct llmem_chat_message *m,
                         int n, int gen, struct tok_buf *b) {
    int st = add(b, tok->bos_text != NULL ? tok->bos_text : "<|begin_of_text|>");
    for (int i = 0; i < n; i++) {
        st |= add(b, "<|start_header_id|>");
        st |= add(b, m[i].role);
        st |= add(b, "<|end_header_id|>\n\n");
        /* (a tool's result as it came) */
        st |= strcmp(m[i].role, "ipython") == 0 ? add_content(b, &m[i]) : add_trimmed(b, &m[i]);
        st |= add(b, "<|eot_id|>");
    }
    if (gen)
        st |= add(b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
    return st ? LLMEM_ENOMEM : LLMEM_OK;
}

/* The spacing of a Mistral template, read from its text (the three published variants differ only
 * in it): v0.2 "[INST] u [/INST]a</s>", v0.1 (updated) " [INST] u [/INST] a</s>", v0.3
 * "[INST] u[/INST] a</s>" with the system message on the last user turn. */
struct mistral_style {
    int space_before_inst;   /* " [INST] " */
    int space_before_close;  /* " [/INST]" */
    int space_before_answer; /* " " + assistant content */
    int trim_answer;         /* assistant content | trim */
    int system_on_last;      /* the system message goes with the last user message, not the first */
    int system_if_last;      /* … and only when that message is the conversation's last (v0.3) */
};

static int has_any(const char *s, const char *a, const char *b) {
    return strstr(s, a) != NULL || strstr(s, b) != NULL;
}

static struct mistral_style mistral_style_of(const char *t) {
    struct mistral_style st = {0, 1, 0, 0, 0, 0}; /* v0.2, also without a template */
    if (t == NULL || strstr(t, "[INST]") == NULL)
        return st;
    st.space_before_inst = has_any(t, "' [INST] '", "\" [INST] \"");
    st.space_before_close = !has_any(t, "+ '[/INST]'", "+ \"[/INST]\"");
    st.space_before_answer = has_any(t, "' ' + message", "\" \" + message");
    st.trim_answer = has_any(t, "content'] | trim + eos", "content\"]|trim + eos") ||
                     has_any(t, "content']|trim + eos", "content\"] | trim + eos");
    st.system_on_last = has_any(t, "loop.last and system_message", "user_messages[-1]") ||
                        strstr(t, "last_user_message") != NULL;
    st.system_if_last = strstr(t, "loop.last and system_message") != NULL;
    return st;
}

static int render_mistral(const struct llmem_tokenizer *tok, const struct llmem_chat_message *m,
                          int n, struct tok_buf *b) {
    const struct llmem_chat_message *system = NULL;
    if (n > 0 && strcmp(m[0].role, "system") == 0) {
        system = &m[0];
        m++, n--;
    }
    int last_user = -1, first_user = -1;
    for (int i = 0, k = 0; i < n; i++) { /* k: the turns that alternate */
        if (mistral_tool_role(m[i].role))
            continue;
        const char *want = k++ % 2 == 0 ? "user" : "assistant";
        if (strcmp(m[i].role, want) != 0) {
            LLMEM_ERROR_AS("llmem_chat_render",
                           "mistral: after the optional system message, roles must alternate "
                           "user/assistant (message %d is '%s')",
                           i + (system != NULL), m[i].role);
            return LLMEM_EINVAL;
        }
        if (strcmp(want, "user") == 0)
            last_user = i, first_user = first_user < 0 ? i : first_user;
    }
    struct mistral_style style = mistral_style_of(tok->chat_template);
    int system_at = style.system_on_last ? last_user : first_user;
    if (style.system_if_last && last_user != n - 1)
        system_at = -1; /* (v0.3's template drops it then) */
    int st = add(b, tok->bos_text != NULL ? tok->bos_text : "<s>");
    for (int i = 0; i < n; i++) {
        if (mistral_tool_role(m[i].role)) {
            st |= add_content(b, &m[i]);
            if (strcmp(m[i].role, "tool_calls") == 0)
                st |= add(b, tok->eos_text != NULL ? tok->eos_text : "</s>");
        } else if (strcmp(m[i].role, "user") == 0) {
            st |= add(b, style.space_before_inst ? " [INST] " : "[INST] ");
            if (i == system_at && system != NULL) {
                st |= add_content(b, system);
                st |= add(b, "\n\n");
            }
            st |= add_content(b, &m[i]);
            st |= add(b, style.space_before_close ? " [/INST]" : "[/INST]");
        } else {
            if (style.space_before_answer)
                st |= add(b, " ");
            st |= style.trim_answer ? add_trimmed(b, &m[i]) : add_content(b, &m[i]);
            st |= add(b, tok->eos_text != NULL ? tok->eos_text : "</s>");
        }
    }
    return st ? LLMEM_ENOMEM : LLMEM_OK;
}

int llmem_chat_render(const struct llmem_tokenizer *tok, enum llmem_chat_template t,
                      const struct llmem_chat_message *messages, int n_messages,
                      int add_generation_prompt, char **text, size_t *len) {
    LLMEM_ASSERT(tok != NULL && text != NULL && n_messages >= 0 &&
                 (messages != NULL || n_messages == 0));
    *text = NULL;
    if (len != NULL)
        *len = 0;
    if (t != LLMEM_CHAT_CHATML && t != LLMEM_CHAT_LLAMA3 && t != LLMEM_CHAT_MISTRAL) {
        LLMEM_ERROR("no chat template to render with; pass --chat-template chatml|llama3|mistral");
        return LLMEM_EINVAL;
    }
    for (int i = 0; i < n_messages; i++) {
        if (messages[i].role == NULL || messages[i].content == NULL ||
            !known_role(messages[i].role, t)) {
            LLMEM_ERROR("message %d: role '%s' is not system, user or assistant (or llama3's "
                        "ipython, mistral's available_tools, tool_calls and tool_results)",
                        i, messages[i].role ? messages[i].role : "(null)");
            return LLMEM_EINVAL;
        }
    }
    struct tok_buf b = {0};
    int status = llmem_tok_buf_reserve(&b, 256);
    if (status == LLMEM_OK) {
        if (t == LLMEM_CHAT_CHATML)
            status = render_chatml(tok, messages, n_messages, add_generation_prompt, &b);
        else if (t == LLMEM_CHAT_LLAMA3)
            status = render_llama3(tok, messages, n_messages, add_generation_prompt, &b);
        else
            status = render_mistral(tok, messages, n_messages, &b);
    }
    if (status != LLMEM_OK) {
        if (status == LLMEM_ENOMEM)
            LLMEM_ERROR("out of memory");
        llmem_tok_buf_free(&b);
        return status;
    }
    *text = b.p;
    if (len != NULL)
        *len = b.n;
    return LLMEM_OK;
}

int llmem_chat_stop_ids(const struct llmem_tokenizer *tok, enum llmem_chat_template t, int32_t *ids,
                        int max) {
    LLMEM_ASSERT(tok != NULL && (ids != NULL || max == 0));
    const char *stops[2] = {NULL, NULL};
    if (t == LLMEM_CHAT_CHATML)
        stops[0] = "<|im_end|>", stops[1] = "<|endoftext|>";
    else if (t == LLMEM_CHAT_LLAMA3)
        stops[0] = "<|eot_id|>", stops[1] = "<|eom_id|>";
    else if (t == LLMEM_CHAT_MISTRAL)
        stops[0] = tok->eos_text != NULL ? tok->eos_text : "</s>";
    int n = 0;
    for (int i = 0; i < 2; i++) {
        if (stops[i] == NULL)
            continue;
        int32_t id = llmem_tok_piece_id(tok, stops[i], strlen(stops[i]));
        if (id < 0)
            continue;
        if (n < max)
            ids[n] = id;
        n++;
    }
    return n;
}
