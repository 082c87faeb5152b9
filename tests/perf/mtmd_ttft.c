/* Time llama.cpp's image prompt through libmtmd the way llama-mtmd-cli runs one: encode time
 * and time to first token, one JSON line a round. Not a test; driven by
 * tests/perf/bench_vision_vs_mtmd.py (--llama-driver), built there or by gpu_vision_mtmd.sh:
 *
 *   gcc -O2 -o mtmd_ttft tests/perf/mtmd_ttft.c -I$SRC/include -I$SRC/ggml/include \
 *       -I$SRC/tools/mtmd -L$LIB -lmtmd -lllama -lggml -lggml-base -Wl,-rpath,$LIB
 *   mtmd_ttft TEXT.gguf MMPROJ.gguf PROMPT_FILE IMAGE [--threads T] [--ngl N] [--ctx N]
 *             [--batch N] [--ubatch N] [--rounds R] [--stdin] [--verbose]
 *
 * PROMPT_FILE holds the chat-formatted prompt with one mtmd_default_marker() ("<__media__>");
 * special tokens are parsed, none added (the template writes BOS where the model has one).
 * What a round does is llama-mtmd-cli's eval_message (tools/mtmd/mtmd-cli.cpp, 3f545bec) plus
 * its first greedy sample: the KV cache cleared; the image file read and decoded
 * (mtmd_helper_bitmap_init_from_file) and the prompt tokenized with it (mtmd_tokenize: the
 * family's preprocessing); then chunk by chunk, text by mtmd_helper_eval_chunk_single, media by
 * mtmd_batch_init/add_chunk/encode (the tower + projector) and mtmd_helper_decode_image_chunk
 * (the embeddings through the text model); then the argmax of the last logits (temp 0). Defaults
 * are mtmd-cli's: n_batch 2048, n_ubatch 512, every layer on the GPU when there is one (--ngl
 * 999), flash attention "auto" in the text model and the encoder (on where the backend supports
 * it: the ready line says what it became; "enabled" would run an unsupported encoder attention on
 * the CPU), mtmd's warm-up encode on, n_ctx 4096. Times are ggml_time_us around each step (every step returns with the results on the
 * host: synchronous). One line per round:
 *   {"round":R,"read_tokenize_ms":..,"encode_ms":..,"image_decode_ms":..,"text_ms":..,
 *    "ttft_ms":..,"prompt_tokens":..,"n_pos":..,"image_tokens":..,"first_token":..}
 * (n_pos: the positions the prompt took; fewer than its tokens where an image's tokens share
 * M-RoPE positions, as Qwen's do)
 * after a first line {"ready":true,"load_ms":..,"text_flash_attn":..,"encoder_flash_attn":..,
 * "system_info":".."}. With --stdin a round starts
 * on each line read from stdin (so a caller can alternate rounds with another program) until EOF.
 */

#include "ggml.h"
#include "llama.h"
#include "mtmd-helper.h"
#include "mtmd.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int g_verbose = 0;
static const char * g_text_fa = "?";  /* what flash-attention "auto" resolved to, from the log */
static const char * g_encoder_fa = "?";

static void log_cb(enum ggml_log_level level, const char * text, void * user) {
    (void) user;
    if (strstr(text, "resolve_fused_ops: Flash Attention")) {  /* "enabled" or "not supported" */
        g_text_fa = strstr(text, "enabled") ? "enabled" : "disabled";
    } else if (strstr(text, "warmup: flash attention is")) {
        g_encoder_fa = strstr(text, "enabled") ? "enabled" : "disabled";
    }
    if (g_verbose || level == GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

static char * read_file(const char * path) {
    FILE * f = fopen(path, "rb");
    if (!f) {
        return NULL;
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char * buf = malloc((size_t) n + 1);
    if (fread(buf, 1, (size_t) n, f) != (size_t) n) {
        fclose(f);
        free(buf);
        return NULL;
    }
    buf[n] = 0;
    fclose(f);
    return buf;
}

static double ms_since(int64_t t0) {
    return (double) (ggml_time_us() - t0) / 1e3;
}

/* One image prompt to its first token; returns 0 and prints the round's line. */
static int round_once(int r, mtmd_context * mctx, struct llama_context * lctx, const char * prompt,
                      const char * image, int n_batch, int n_vocab) {
    llama_memory_clear(llama_get_memory(lctx), true);
    double enc = 0, img_dec = 0, text = 0;
    size_t img_tokens = 0;
    int64_t t0 = ggml_time_us();
    struct mtmd_helper_bitmap_wrapper w = mtmd_helper_bitmap_init_from_file(mctx, image, false);
    if (!w.bitmap) {
        fprintf(stderr, "error: cannot read image %s\n", image);
        return 1;
    }
    const mtmd_bitmap * bitmaps[1] = { w.bitmap };
    mtmd_input_chunks * chunks = mtmd_input_chunks_init();
    mtmd_input_text in = { prompt, strlen(prompt), false, true };
    if (mtmd_tokenize(mctx, chunks, &in, bitmaps, 1) != 0) {
        fprintf(stderr, "error: mtmd_tokenize failed (is there one %s in the prompt?)\n", mtmd_default_marker());
        return 1;
    }
    double tok_ms = ms_since(t0);
    llama_pos n_past = 0;
    const size_t n_chunks = mtmd_input_chunks_size(chunks);
    for (size_t i = 0; i < n_chunks; i++) {
        const mtmd_input_chunk * ch = mtmd_input_chunks_get(chunks, i);
        int64_t t = ggml_time_us();
        llama_pos next = n_past;
        if (mtmd_input_chunk_get_type(ch) == MTMD_INPUT_CHUNK_TYPE_TEXT) {
            if (mtmd_helper_eval_chunk_single(mctx, lctx, ch, n_past, 0, n_batch, i == n_chunks - 1, &next)) {
                fprintf(stderr, "error: text chunk %zu failed\n", i);
                return 1;
            }
            text += ms_since(t);
        } else {  /* mtmd-cli batches consecutive media chunks; one image gives one */
            mtmd_batch * mb = mtmd_batch_init(mctx);
            if (mtmd_batch_add_chunk(mb, ch) || mtmd_batch_encode(mb)) {
                fprintf(stderr, "error: encoding media chunk %zu failed\n", i);
                return 1;
            }
            enc += ms_since(t);
            t = ggml_time_us();
            float * embd = mtmd_batch_get_output_embd(mb, ch);
            if (!embd || mtmd_helper_decode_image_chunk(mctx, lctx, ch, embd, n_past, 0, n_batch, &next, NULL, NULL)) {
                fprintf(stderr, "error: decoding media chunk %zu failed\n", i);
                return 1;
            }
            img_dec += ms_since(t);
            img_tokens += mtmd_input_chunk_get_n_tokens(ch);
            mtmd_batch_free(mb);
        }
        n_past = next;
    }
    const float * logits = llama_get_logits_ith(lctx, -1);
    int best = 0;
    for (int v = 1; v < n_vocab; v++) {
        best = logits[v] > logits[best] ? v : best;
    }
    double ttft = ms_since(t0);
    printf("{\"round\":%d,\"read_tokenize_ms\":%.3f,\"encode_ms\":%.3f,\"image_decode_ms\":%.3f,"
           "\"text_ms\":%.3f,\"ttft_ms\":%.3f,\"prompt_tokens\":%zu,\"n_pos\":%d,\"image_tokens\":%zu,"
           "\"first_token\":%d}\n",
           r, tok_ms, enc, img_dec, text, ttft, mtmd_helper_get_n_tokens(chunks), (int) n_past, img_tokens, best);
    fflush(stdout);
    mtmd_input_chunks_free(chunks);
    mtmd_bitmap_free(w.bitmap);
    return 0;
}

int main(int argc, char ** argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s TEXT.gguf MMPROJ.gguf PROMPT_FILE IMAGE [--threads T] [--ngl N] [--ctx N]\n"
                        "       [--batch N] [--ubatch N] [--rounds R] [--stdin] [--verbose]\n", argv[0]);
        return 2;
    }
    int threads = 2, ngl = 999, n_ctx = 4096, n_batch = 2048, n_ubatch = 512, rounds = 3, from_stdin = 0;
    for (int i = 5; i < argc; i++) {
        const char * a = argv[i];
        const int more = i + 1 < argc;
        if (!strcmp(a, "--threads") && more) {
            threads = atoi(argv[++i]);
        } else if (!strcmp(a, "--ngl") && more) {
            ngl = atoi(argv[++i]);
        } else if (!strcmp(a, "--ctx") && more) {
            n_ctx = atoi(argv[++i]);
        } else if (!strcmp(a, "--batch") && more) {
            n_batch = atoi(argv[++i]);
        } else if (!strcmp(a, "--ubatch") && more) {
            n_ubatch = atoi(argv[++i]);
        } else if (!strcmp(a, "--rounds") && more) {
            rounds = atoi(argv[++i]);
        } else if (!strcmp(a, "--stdin")) {
            from_stdin = 1;
        } else if (!strcmp(a, "--verbose")) {
            g_verbose = 1;
        } else {
            fprintf(stderr, "error: unknown argument %s\n", a);
            return 2;
        }
    }
    char * prompt = read_file(argv[3]);
    if (!prompt) {
        fprintf(stderr, "error: cannot read %s\n", argv[3]);
        return 1;
    }
    ggml_time_init();
    int64_t t0 = ggml_time_us();
    llama_log_set(log_cb, NULL);
    mtmd_helper_log_set(log_cb, NULL);
    ggml_backend_load_all();
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = ngl;
    struct llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        fprintf(stderr, "error: cannot load %s\n", argv[1]);
        return 1;
    }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t) n_ctx;
    cp.n_batch = (uint32_t) n_batch;
    cp.n_ubatch = (uint32_t) n_ubatch;
    cp.n_seq_max = 1;
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_AUTO;
    struct llama_context * lctx = llama_init_from_model(model, cp);
    struct mtmd_context_params mparams = mtmd_context_params_default();
    mparams.use_gpu = ngl > 0;
    mparams.print_timings = false;
    mparams.n_threads = threads;
    mparams.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_AUTO;
    mparams.warmup = true;
    mtmd_context * mctx = lctx ? mtmd_init_from_file(argv[2], model, mparams) : NULL;
    if (!lctx || !mctx) {
        fprintf(stderr, "error: cannot create the llama or mtmd context for %s\n", argv[2]);
        return 1;
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    printf("{\"ready\":true,\"load_ms\":%.1f,\"text_flash_attn\":\"%s\",\"encoder_flash_attn\":\"%s\","
           "\"system_info\":\"%s\"}\n", ms_since(t0), g_text_fa, g_encoder_fa, llama_print_system_info());
    fflush(stdout);
    char line[256];
    for (int r = 0; from_stdin || r < rounds; r++) {
        if (from_stdin && !fgets(line, sizeof line, stdin)) {
            break;
        }
        if (round_once(r, mctx, lctx, prompt, argv[4], n_batch, n_vocab)) {
            return 1;
        }
    }
    mtmd_free(mctx);
    llama_free(lctx);
    llama_model_free(model);
    free(prompt);
    return 0;
}
