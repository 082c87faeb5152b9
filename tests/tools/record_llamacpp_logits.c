/* Record llama.cpp's logits for given token ids, as JSON, straight through llama.h.
 *
 * Built and driven by tests/tools/record_llamacpp_logits.py against a CPU build of llama.cpp
 * (libllama + ggml). Two commands:
 *
 *   record_llamacpp_logits to-f32 IN.gguf OUT.gguf
 *       llama_model_quantize with LLAMA_FTYPE_ALL_F32 and pure=true: every F16 weight widened
 *       to F32 by llama.cpp itself, so its matmuls run in fp32 (F16 weights make ggml's CPU
 *       matmul round the activations to F16 first).
 *
 *   record_llamacpp_logits logits MODEL.gguf --ids 1,2,3 [--chunks 3,7,1] [--greedy N]
 *                                [--prompt P] [--kv f32|f16] [--fa on|off|auto] [--threads 1]
 *       prints {"n_vocab", "system_info", "whole", "chunked", "chunks", "greedy_ids", "greedy_logits"}:
 *       "whole" the logits of every position from one llama_decode of all ids; "chunked" the
 *       same ids fed in consecutive batches of the --chunks sizes (the rest in one last batch)
 *       through the context's memory (KV cache and recurrent state); "greedy_ids" N argmax
 *       tokens generated one decode at a time after the first P ids (default all), "greedy_logits" the logits each
 *       step chose from. Each run uses a fresh context. Floats are printed with %.9g, so they
 *       read back as the exact float32 values.
 */

#include "llama.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_IDS 4096

static void quiet_log(enum ggml_log_level level, const char * text, void * user) {
    (void) user;
    if (level == GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

static int parse_list(const char * s, int * out, int cap) {
    int n = 0;
    while (*s) {
        char * end;
        long v = strtol(s, &end, 10);
        if (end == s || n == cap) {
            return -1;
        }
        out[n++] = (int) v;
        s = *end == ',' ? end + 1 : end;
        if (*end && *end != ',') {
            return -1;
        }
    }
    return n;
}

struct opts {
    int ids[MAX_IDS], n_ids;
    int chunks[MAX_IDS], n_chunks;
    int greedy, prompt;
    enum ggml_type kv;
    enum llama_flash_attn_type fa;
    int threads;
};

static struct llama_context * new_context(struct llama_model * model, const struct opts * o) {
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 512;
    cp.n_batch = 512;
    cp.n_ubatch = 512;
    cp.n_seq_max = 1;
    cp.n_threads = o->threads;
    cp.n_threads_batch = o->threads;
    cp.type_k = o->kv;
    cp.type_v = o->kv;
    cp.flash_attn_type = o->fa;
    cp.no_perf = true;
    return llama_init_from_model(model, cp);
}

/* Decode ids[s:e] at positions s..e-1 of sequence 0, every position an output. */
static int decode(struct llama_context * ctx, const int * ids, int s, int e) {
    struct llama_batch b = llama_batch_init(e - s, 0, 1);
    for (int i = s; i < e; i++) {
        int j = i - s;
        b.token[j] = ids[i];
        b.pos[j] = i;
        b.n_seq_id[j] = 1;
        b.seq_id[j][0] = 0;
        b.logits[j] = 1;
    }
    b.n_tokens = e - s;
    int rc = llama_decode(ctx, b);
    llama_batch_free(b);
    return rc;
}

static void print_row(const float * row, int n_vocab) {
    putchar('[');
    for (int v = 0; v < n_vocab; v++) {
        printf(v ? ",%.9g" : "%.9g", row[v]);
    }
    putchar(']');
}

/* Feed the ids in batches of the given sizes; print every position's logits as a JSON array. */
static int run_batches(struct llama_model * model, const struct opts * o, const int * sizes,
                       int n_sizes, int n_vocab) {
    struct llama_context * ctx = new_context(model, o);
    if (!ctx) {
        fprintf(stderr, "error: llama_init_from_model failed\n");
        return 1;
    }
    putchar('[');
    int s = 0;
    for (int k = 0; s < o->n_ids; k++) {
        int e = k < n_sizes ? s + sizes[k] : o->n_ids;
        if (e > o->n_ids) {
            e = o->n_ids;
        }
        if (decode(ctx, o->ids, s, e) != 0) {
            fprintf(stderr, "error: llama_decode failed on positions %d..%d\n", s, e - 1);
            llama_free(ctx);
            return 1;
        }
        for (int i = 0; i < e - s; i++) {
            if (s + i) {
                putchar(',');
            }
            print_row(llama_get_logits_ith(ctx, i), n_vocab);
        }
        s = e;
    }
    putchar(']');
    llama_free(ctx);
    return 0;
}

static int argmax(const float * row, int n) {
    int best = 0;
    for (int v = 1; v < n; v++) {
        if (row[v] > row[best]) {
            best = v;
        }
    }
    return best;
}

/* Greedy generation after the first `prompt` ids, one token per decode; prints ids then the rows chosen from. */
static int run_greedy(struct llama_model * model, const struct opts * o, int n_vocab) {
    struct llama_context * ctx = new_context(model, o);
    int seq[MAX_IDS];
    float * rows = malloc(sizeof(float) * (size_t) n_vocab * (size_t) (o->greedy + 1));
    if (!ctx || !rows || o->prompt + o->greedy > MAX_IDS) {
        fprintf(stderr, "error: cannot set up the greedy run\n");
        return 1;
    }
    memcpy(seq, o->ids, sizeof(int) * (size_t) o->prompt);
    int n = o->prompt, rc = decode(ctx, seq, 0, n);
    for (int step = 0; rc == 0 && step < o->greedy; step++) {
        const float * row = llama_get_logits_ith(ctx, -1);
        memcpy(rows + (size_t) step * n_vocab, row, sizeof(float) * (size_t) n_vocab);
        seq[n] = argmax(row, n_vocab);
        n++;
        if (step + 1 < o->greedy) {
            rc = decode(ctx, seq, n - 1, n);
        }
    }
    if (rc != 0) {
        fprintf(stderr, "error: llama_decode failed in the greedy run\n");
        return 1;
    }
    printf(",\"greedy_ids\":[");
    for (int i = 0; i < o->greedy; i++) {
        printf(i ? ",%d" : "%d", seq[o->prompt + i]);
    }
    printf("],\"greedy_logits\":[");
    for (int i = 0; i < o->greedy; i++) {
        if (i) {
            putchar(',');
        }
        print_row(rows + (size_t) i * n_vocab, n_vocab);
    }
    putchar(']');
    free(rows);
    llama_free(ctx);
    return 0;
}

static int cmd_to_f32(const char * in, const char * out) {
    llama_model_quantize_params qp = llama_model_quantize_default_params();
    qp.ftype = LLAMA_FTYPE_ALL_F32;
    qp.pure = true;
    qp.nthread = 1;
    if (llama_model_quantize(in, out, &qp) != 0) {
        fprintf(stderr, "error: llama_model_quantize %s -> %s failed\n", in, out);
        return 1;
    }
    return 0;
}

static int cmd_logits(const char * path, struct opts * o) {
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    struct llama_model * model = llama_model_load_from_file(path, mp);
    if (!model) {
        fprintf(stderr, "error: cannot load %s\n", path);
        return 1;
    }
    int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    int whole = o->n_ids;
    printf("{\"n_vocab\":%d,\"system_info\":\"", n_vocab);
    for (const char * c = llama_print_system_info(); *c; c++) {
        if (*c == '"' || *c == '\\') {
            putchar('\\');
        }
        if ((unsigned char) *c >= 0x20) {
            putchar(*c);
        }
    }
    printf("\",\"whole\":");
    int rc = run_batches(model, o, &whole, 1, n_vocab);
    if (rc == 0 && o->n_chunks > 0) {
        printf(",\"chunks\":[");
        for (int i = 0; i < o->n_chunks; i++) {
            printf(i ? ",%d" : "%d", o->chunks[i]);
        }
        printf("],\"chunked\":");
        rc = run_batches(model, o, o->chunks, o->n_chunks, n_vocab);
    }
    if (rc == 0 && o->greedy > 0) {
        rc = run_greedy(model, o, n_vocab);
    }
    printf("}\n");
    llama_model_free(model);
    return rc;
}

static int usage(void) {
    fprintf(stderr,
            "usage: record_llamacpp_logits to-f32 IN.gguf OUT.gguf\n"
            "       record_llamacpp_logits logits MODEL.gguf --ids 1,2,3 [--chunks 3,7]"
            " [--greedy N] [--prompt P] [--kv f32|f16] [--fa on|off|auto] [--threads N]\n");
    return 2;
}

int main(int argc, char ** argv) {
    if (argc < 3) {
        return usage();
    }
    llama_log_set(quiet_log, NULL);
    llama_backend_init();
    int rc;
    if (strcmp(argv[1], "to-f32") == 0 && argc == 4) {
        rc = cmd_to_f32(argv[2], argv[3]);
    } else if (strcmp(argv[1], "logits") == 0) {
        static struct opts o = {.kv = GGML_TYPE_F32, .fa = LLAMA_FLASH_ATTN_TYPE_DISABLED, .threads = 1};
        for (int i = 3; i + 1 < argc; i += 2) {
            const char * k = argv[i], * v = argv[i + 1];
            if (strcmp(k, "--ids") == 0) {
                o.n_ids = parse_list(v, o.ids, MAX_IDS);
            } else if (strcmp(k, "--chunks") == 0) {
                o.n_chunks = parse_list(v, o.chunks, MAX_IDS);
            } else if (strcmp(k, "--prompt") == 0) {
                o.prompt = atoi(v);
            } else if (strcmp(k, "--greedy") == 0) {
                o.greedy = atoi(v);
            } else if (strcmp(k, "--kv") == 0 && (!strcmp(v, "f32") || !strcmp(v, "f16"))) {
                o.kv = strcmp(v, "f32") == 0 ? GGML_TYPE_F32 : GGML_TYPE_F16;
            } else if (strcmp(k, "--fa") == 0 && (!strcmp(v, "on") || !strcmp(v, "off") || !strcmp(v, "auto"))) {
                o.fa = !strcmp(v, "on") ? LLAMA_FLASH_ATTN_TYPE_ENABLED
                     : !strcmp(v, "off") ? LLAMA_FLASH_ATTN_TYPE_DISABLED : LLAMA_FLASH_ATTN_TYPE_AUTO;
            } else if (strcmp(k, "--threads") == 0) {
                o.threads = atoi(v);
            } else {
                fprintf(stderr, "error: bad option %s %s\n", k, v);
                return usage();
            }
        }
        o.prompt = o.prompt ? o.prompt : o.n_ids;
        if (o.n_ids <= 0 || o.n_chunks < 0 || o.greedy < 0 || o.threads < 1 || o.prompt < 1 ||
            o.prompt > o.n_ids) {
            fprintf(stderr, "error: --ids must be a comma list of token ids, 1 <= --prompt <= their"
                            " count, other counts >= 0\n");
            return usage();
        }
        rc = cmd_logits(argv[2], &o);
    } else {
        return usage();
    }
    llama_backend_free();
    return rc;
}
