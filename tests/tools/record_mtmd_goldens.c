/* Record llama.cpp's multimodal (libmtmd) outputs on a text GGUF + mmproj pair, as JSON.
 *
 * Built and driven by tests/tools/record_mtmd_goldens.py against a CPU build of llama.cpp
 * (libllama + libmtmd + ggml):
 *
 *   record_mtmd_goldens TEXT.gguf MMPROJ.gguf PROMPT_FILE [IMAGE ...]
 *                       [--greedy N] [--threads 1] [--kv f32|f16] [--add-special 0|1]
 *                       [--ids 1,2,3 --image-token ID] [--min-tokens N] [--max-tokens N]
 *
 * PROMPT_FILE holds the prompt text with one mtmd_default_marker() ("<__media__>") per image.
 * Prints {"n_vocab", "n_embd_inp", "system_info", "chunks", "embd", "n_past", "prompt_logits",
 * "greedy_logits", "greedy_ids"}: "chunks" is mtmd_tokenize's split (text chunks with their ids,
 * image chunks with n_tokens and n_pos); "embd" each image chunk's projector output
 * (mtmd_encode_chunk + mtmd_get_output_embd, n_tokens rows of n_embd_inp floats); "prompt_logits"
 * the logits after the whole prompt (mtmd_helper_eval_chunks, which handles M-RoPE positions and
 * Gemma 3's non-causal image spans), then N greedy tokens decoded one a step at the next
 * positions, each with the logits it was chosen from. With --ids the prompt decoded is those ids instead of mtmd's own split:
 * text runs by llama_decode, each run of --image-token ids by mtmd_helper_decode_image_chunk with
 * the next image chunk's rows (its token count must equal the run's: exit 3 otherwise), so both
 * engines see the same prompt. --min-tokens/--max-tokens set mtmd's image token bounds (Qwen's
 * min/max pixels). Floats are printed with %.9g (exact float32 round trip). One fresh
 * context, flash attention off in the encoder and the text model.
 */

#include "llama.h"
#include "mtmd-helper.h"
#include "mtmd.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_IMAGES 8
#define MAX_IDS 4096

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
    }
    return n;
}

static void quiet_log(enum ggml_log_level level, const char * text, void * user) {
    (void) user;
    if (level == GGML_LOG_LEVEL_ERROR) {
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

static void print_floats(const float * v, size_t n) {
    putchar('[');
    for (size_t i = 0; i < n; i++) {
        printf(i ? ",%.9g" : "%.9g", v[i]);
    }
    putchar(']');
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

int main(int argc, char ** argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s TEXT.gguf MMPROJ.gguf PROMPT_FILE [IMAGE ...] [--greedy N] "
                        "[--threads T] [--kv f32|f16] [--add-special 0|1] [--ids 1,2,3 --image-token ID]\n"
                        "       [--min-tokens N] [--max-tokens N]\n", argv[0]);
        return 2;
    }
    const char * images[MAX_IMAGES];
    int n_images = 0, greedy = 8, threads = 1, add_special = 0, n_ids = 0, image_token = -1;
    int min_tokens = -1, max_tokens = -1;
    static int ids[MAX_IDS];
    enum ggml_type kv = GGML_TYPE_F32;
    for (int i = 4; i < argc; i++) {
        if (!strcmp(argv[i], "--greedy") && i + 1 < argc) {
            greedy = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--threads") && i + 1 < argc) {
            threads = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--kv") && i + 1 < argc) {
            kv = strcmp(argv[++i], "f16") ? GGML_TYPE_F32 : GGML_TYPE_F16;
        } else if (!strcmp(argv[i], "--min-tokens") && i + 1 < argc) {
            min_tokens = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--max-tokens") && i + 1 < argc) {
            max_tokens = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--ids") && i + 1 < argc) {
            n_ids = parse_list(argv[++i], ids, MAX_IDS);
        } else if (!strcmp(argv[i], "--image-token") && i + 1 < argc) {
            image_token = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--add-special") && i + 1 < argc) {
            add_special = atoi(argv[++i]);
        } else if (n_images < MAX_IMAGES) {
            images[n_images++] = argv[i];
        } else {
            fprintf(stderr, "error: too many images (max %d)\n", MAX_IMAGES);
            return 2;
        }
    }
    char * prompt = read_file(argv[3]);
    if (!prompt) {
        fprintf(stderr, "error: cannot read %s\n", argv[3]);
        return 1;
    }

    llama_log_set(quiet_log, NULL);
    mtmd_helper_log_set(quiet_log, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    struct llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        fprintf(stderr, "error: cannot load %s\n", argv[1]);
        return 1;
    }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 2048;
    cp.n_batch = 2048;
    cp.n_ubatch = 2048;
    cp.n_seq_max = 1;
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    cp.type_k = kv;
    cp.type_v = kv;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.no_perf = true;
    struct llama_context * lctx = llama_init_from_model(model, cp);

    struct mtmd_context_params mparams = mtmd_context_params_default();
    mparams.use_gpu = false;
    mparams.print_timings = false;
    mparams.n_threads = threads;
    mparams.warmup = false;
    mparams.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    mparams.image_min_tokens = min_tokens;
    mparams.image_max_tokens = max_tokens;
    mtmd_context * mctx = mtmd_init_from_file(argv[2], model, mparams);
    if (!lctx || !mctx) {
        fprintf(stderr, "error: cannot create the llama or mtmd context for %s\n", argv[2]);
        return 1;
    }

    const mtmd_bitmap * bitmaps[MAX_IMAGES];
    for (int i = 0; i < n_images; i++) {
        struct mtmd_helper_bitmap_wrapper w = mtmd_helper_bitmap_init_from_file(mctx, images[i], false);
        if (!w.bitmap) {
            fprintf(stderr, "error: cannot read image %s\n", images[i]);
            return 1;
        }
        bitmaps[i] = w.bitmap;
    }
    mtmd_input_chunks * chunks = mtmd_input_chunks_init();
    mtmd_input_text text = { prompt, strlen(prompt), add_special != 0, true };
    int32_t rc = mtmd_tokenize(mctx, chunks, &text, bitmaps, (size_t) n_images);
    if (rc != 0) {
        fprintf(stderr, "error: mtmd_tokenize returned %d\n", rc);
        return 1;
    }

    const struct llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    const int n_embd = llama_model_n_embd_inp(model);
    const size_t n_chunks = mtmd_input_chunks_size(chunks);
    printf("{\"n_vocab\":%d,\"n_embd_inp\":%d,\"system_info\":\"%s\",\"chunks\":[", n_vocab, n_embd,
           llama_print_system_info());
    for (size_t c = 0; c < n_chunks; c++) {
        const mtmd_input_chunk * ch = mtmd_input_chunks_get(chunks, c);
        if (mtmd_input_chunk_get_type(ch) == MTMD_INPUT_CHUNK_TYPE_TEXT) {
            size_t n;
            const llama_token * ids = mtmd_input_chunk_get_tokens_text(ch, &n);
            printf(c ? ",{\"type\":\"text\",\"ids\":[" : "{\"type\":\"text\",\"ids\":[");
            for (size_t i = 0; i < n; i++) {
                printf(i ? ",%d" : "%d", ids[i]);
            }
            printf("]}");
        } else {
            printf(c ? ",{\"type\":\"image\",\"n_tokens\":%zu,\"n_pos\":%d}" : "{\"type\":\"image\",\"n_tokens\":%zu,\"n_pos\":%d}",
                   mtmd_input_chunk_get_n_tokens(ch), (int) mtmd_input_chunk_get_n_pos(ch));
        }
    }
    printf("],\"embd\":[");
    fflush(stdout);

    /* Every image chunk's projector output, in order. */
    float * embd[64];
    size_t n_img = 0;
    for (size_t c = 0; c < n_chunks && n_img < 64; c++) {
        const mtmd_input_chunk * ch = mtmd_input_chunks_get(chunks, c);
        if (mtmd_input_chunk_get_type(ch) != MTMD_INPUT_CHUNK_TYPE_IMAGE) {
            continue;
        }
        size_t n = mtmd_input_chunk_get_n_tokens(ch) * (size_t) n_embd;
        if (mtmd_encode_chunk(mctx, ch) != 0) {
            fprintf(stderr, "error: mtmd_encode_chunk failed on chunk %zu\n", c);
            return 1;
        }
        embd[n_img] = malloc(sizeof(float) * n);
        memcpy(embd[n_img], mtmd_get_output_embd(mctx), sizeof(float) * n);
        if (n_img) {
            putchar(',');
        }
        print_floats(embd[n_img++], n);
    }
    printf("]");

    llama_pos n_past = 0;
    if (n_ids == 0) {  /* llama.cpp's own prompt layout */
        if (mtmd_helper_eval_chunks(mctx, lctx, chunks, 0, 0, cp.n_batch, true, &n_past) != 0) {
            fprintf(stderr, "error: mtmd_helper_eval_chunks failed\n");
            return 1;
        }
    } else {  /* the given ids; each run of image_token takes the next image chunk's rows */
        size_t c = 0, k = 0;
        struct llama_batch tb = llama_batch_init(MAX_IDS, 0, 1);
        for (int i = 0; i < n_ids;) {
            int j = i;
            if (ids[i] == image_token) {
                while (j < n_ids && ids[j] == image_token) {
                    j++;
                }
                while (c < n_chunks && mtmd_input_chunk_get_type(mtmd_input_chunks_get(chunks, c)) != MTMD_INPUT_CHUNK_TYPE_IMAGE) {
                    c++;
                }
                if (c == n_chunks || mtmd_input_chunk_get_n_tokens(mtmd_input_chunks_get(chunks, c)) != (size_t) (j - i)) {
                    fprintf(stderr, "error: image run at %d has %d tokens, llama.cpp's chunk %zu has %zu\n", i, j - i, c,
                            c == n_chunks ? (size_t) 0 : mtmd_input_chunk_get_n_tokens(mtmd_input_chunks_get(chunks, c)));
                    return 3;
                }
                if (mtmd_helper_decode_image_chunk(mctx, lctx, mtmd_input_chunks_get(chunks, c), embd[k], n_past, 0,
                                                   cp.n_batch, &n_past, NULL, NULL) != 0) {
                    fprintf(stderr, "error: mtmd_helper_decode_image_chunk failed at %d\n", i);
                    return 1;
                }
                c++, k++;
            } else {
                while (j < n_ids && ids[j] != image_token) {
                    j++;
                }
                tb.n_tokens = j - i;
                for (int t = i; t < j; t++) {
                    tb.token[t - i] = ids[t];
                    tb.pos[t - i] = n_past + (t - i);
                    tb.n_seq_id[t - i] = 1;
                    tb.seq_id[t - i][0] = 0;
                    tb.logits[t - i] = t == j - 1;
                }
                if (llama_decode(lctx, tb) != 0) {
                    fprintf(stderr, "error: llama_decode failed on ids %d..%d\n", i, j - 1);
                    return 1;
                }
                n_past += j - i;
            }
            i = j;
        }
        llama_batch_free(tb);
        if (ids[n_ids - 1] == image_token) {
            fprintf(stderr, "error: the ids must end with text\n");
            return 1;
        }
    }
    const float * row = llama_get_logits_ith(lctx, -1);
    printf(",\"n_past\":%d,\"prompt_logits\":", (int) n_past);
    print_floats(row, (size_t) n_vocab);
    int * out = malloc(sizeof(int) * (size_t) (greedy + 1));
    printf(",\"greedy_logits\":[");
    struct llama_batch b = llama_batch_init(1, 0, 1);
    for (int s = 0; s < greedy; s++) {
        if (s) {
            putchar(',');
        }
        print_floats(row, (size_t) n_vocab);
        out[s] = argmax(row, n_vocab);
        if (s + 1 == greedy) {
            break;
        }
        b.n_tokens = 1;
        b.token[0] = out[s];
        b.pos[0] = n_past++;
        b.n_seq_id[0] = 1;
        b.seq_id[0][0] = 0;
        b.logits[0] = 1;
        if (llama_decode(lctx, b) != 0) {
            fprintf(stderr, "error: llama_decode failed at greedy step %d\n", s);
            return 1;
        }
        row = llama_get_logits_ith(lctx, -1);
    }
    printf("],\"greedy_ids\":[");
    for (int s = 0; s < greedy; s++) {
        printf(s ? ",%d" : "%d", out[s]);
    }
    printf("]}\n");
    llama_batch_free(b);
    mtmd_input_chunks_free(chunks);
    mtmd_free(mctx);
    llama_free(lctx);
    llama_model_free(model);
    free(out);
    free(prompt);
    return 0;
}
