/*
 * Reference token ids from llama.cpp, for the tokenizer conformance data in
 * tests/data/vocab/.
 *
 * Build against a llama.cpp build (libllama):
 *   cc -O1 -I LLAMA/include -I LLAMA/ggml/include scripts/llama_tokenize_ref.c \
 *      -L BUILD/bin -lllama -Wl,-rpath,BUILD/bin -o llama_tokenize_ref
 *
 * Usage:
 *   llama_tokenize_ref VOCAB.gguf cases CASES_FILE ADD_SPECIAL PARSE_SPECIAL
 *     CASES_FILE holds texts separated by "\n__ggml_vocab_test__\n" (the
 *     format of llama.cpp's models/ggml-vocab-*.gguf.inp).  Prints one line
 *     per case: the ids, a tab, the hex bytes of llama_detokenize(ids,
 *     remove_special=false, unparse_special=false), a tab, the same with
 *     unparse_special=true.
 *   llama_tokenize_ref VOCAB.gguf vocab
 *     Prints "bos eos eot add_bos add_eos n_tokens", then per token:
 *     id, attribute bits, is_eog, hex piece (special=false), hex piece
 *     (special=true).
 */
#define _GNU_SOURCE
#include "llama.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void quiet(enum ggml_log_level level, const char * text, void * user) {
    (void) level; (void) text; (void) user;
}

static void print_hex(const char * s, int n) {
    for (int i = 0; i < n; i++) printf("%02x", (unsigned char) s[i]);
}

static char * read_file(const char * path, size_t * len) {
    FILE * f = fopen(path, "rb");
    if (!f) { perror(path); exit(1); }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char * buf = malloc(n + 1);
    if (fread(buf, 1, n, f) != (size_t) n) { perror(path); exit(1); }
    buf[n] = 0;
    fclose(f);
    *len = n;
    return buf;
}

static void detok(const struct llama_vocab * vocab, const llama_token * ids, int n, int special) {
    int cap = 64 + 64 * n;
    char * out = malloc(cap);
    int m = llama_detokenize(vocab, ids, n, out, cap, false, special);
    if (m < 0) { cap = -m; out = realloc(out, cap); m = llama_detokenize(vocab, ids, n, out, cap, false, special); }
    print_hex(out, m);
    free(out);
}

static void one_case(const struct llama_vocab * vocab, const char * text, int len, int add_special, int parse_special) {
    int cap = len + 16;
    llama_token * ids = malloc(sizeof(llama_token) * cap);
    int n = llama_tokenize(vocab, text, len, ids, cap, add_special, parse_special);
    if (n < 0) { cap = -n; ids = realloc(ids, sizeof(llama_token) * cap); n = llama_tokenize(vocab, text, len, ids, cap, add_special, parse_special); }
    for (int i = 0; i < n; i++) printf(i ? " %d" : "%d", ids[i]);
    printf("\t");
    detok(vocab, ids, n, 0);
    printf("\t");
    detok(vocab, ids, n, 1);
    printf("\n");
    free(ids);
}

int main(int argc, char ** argv) {
    if (argc < 3) { fprintf(stderr, "usage: see the comment at the top of this file\n"); return 1; }
    llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.vocab_only = true;
    struct llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    const struct llama_vocab * vocab = llama_model_get_vocab(model);

    if (strcmp(argv[2], "vocab") == 0) {
        int n = llama_vocab_n_tokens(vocab);
        printf("%d %d %d %d %d %d\n", llama_vocab_bos(vocab), llama_vocab_eos(vocab), llama_vocab_eot(vocab),
               llama_vocab_get_add_bos(vocab), llama_vocab_get_add_eos(vocab), n);
        char buf[4096];
        for (int t = 0; t < n; t++) {
            printf("%d %d %d ", t, (int) llama_vocab_get_attr(vocab, t), (int) llama_vocab_is_eog(vocab, t));
            int m = llama_token_to_piece(vocab, t, buf, sizeof buf, 0, false);
            print_hex(buf, m < 0 ? 0 : m);
            printf(" ");
            m = llama_token_to_piece(vocab, t, buf, sizeof buf, 0, true);
            print_hex(buf, m < 0 ? 0 : m);
            printf("\n");
        }
    } else if (strcmp(argv[2], "cases") == 0 && argc >= 6) {
        size_t len;
        char * raw = read_file(argv[3], &len);
        int add_special = atoi(argv[4]), parse_special = atoi(argv[5]);
        const char * sep = "\n__ggml_vocab_test__\n";
        size_t seplen = strlen(sep), pos = 0;
        for (;;) {  /* an empty text after the last separator is a case too */
            char * next = memmem(raw + pos, len - pos, sep, seplen);
            size_t end = next ? (size_t) (next - raw) : len;
            one_case(vocab, raw + pos, (int) (end - pos), add_special, parse_special);
            if (!next) break;
            pos = end + seplen;
        }
        free(raw);
    } else {
        fprintf(stderr, "unknown mode %s\n", argv[2]);
        return 1;
    }
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
