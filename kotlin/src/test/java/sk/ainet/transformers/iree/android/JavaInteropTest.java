package sk.ainet.transformers.iree.android;

import java.io.FileInputStream;
import java.util.Arrays;
import java.util.Properties;

/**
 * The Kotlin API as a Java app sees it (static natives from the companion's @JvmStatic, nullable
 * vmfbPrefill, AutoCloseable sessions), against the same ids as the Kotlin test.
 */
public final class JavaInteropTest {
    private static int failures = 0;

    private static void check(String name, boolean ok) {
        if (!ok) {
            failures++;
            System.out.println("FAILED: " + name);
        }
    }

    private static int[] ints(Properties p, String key) {
        return Arrays.stream(p.getProperty(key).split(",")).mapToInt(Integer::parseInt).toArray();
    }

    private static int i(Properties p, String key) {
        return Integer.parseInt(p.getProperty(key));
    }

    public static void main(String[] args) throws Exception {
        Properties p = new Properties();
        try (FileInputStream in = new FileInputStream(args[0])) {
            p.load(in);
        }
        IreeKvSpec spec = new IreeKvSpec(
            i(p, "spec.nLayers"), i(p, "spec.headDim"), i(p, "spec.nKvHeads"), i(p, "spec.nHeads"),
            i(p, "spec.hiddenSize"), i(p, "spec.vocabSize"), i(p, "spec.slidingWindow"),
            i(p, "spec.globalLayerPeriod"), i(p, "spec.chunk"), i(p, "spec.maskHeads"),
            Float.parseFloat(p.getProperty("spec.slidingRopeBase")),
            Float.parseFloat(p.getProperty("spec.globalRopeBase")));
        try (IreeKvSession session = IreeKvSession.open("local-sync", spec,
                p.getProperty("withPast.vmfb"), p.getProperty("withPast.irpa"), p.getProperty("withPast.function"),
                p.getProperty("chunk.vmfb"), p.getProperty("chunk.irpa"), p.getProperty("chunk.function"),
                p.getProperty("prefill.vmfb"), p.getProperty("prefill.irpa"), p.getProperty("prefill.function"))) {
            IreeKvDecoder decoder = new IreeKvDecoder(session, i(p, "spec.seq"));
            try (IreeKvSession.Snapshot prefix = decoder.prefillPrefix(ints(p, "prefix"))) {
                int[] got = decoder.generate(prefix, ints(p, "utterance.1"), -1, i(p, "maxNew")).getIds();
                check("Java: utterance 1 on local-sync equals the Rust API", Arrays.equals(got, ints(p, "expected.1")));
            }
            try {
                IreeKvSession.nativeStep(0L, 1);
                check("Java: 0 handle throws", false);
            } catch (IllegalStateException expected) {
                check("Java: the message names the method", expected.getMessage().startsWith("IreeKvSession.nativeStep: "));
            }
        }
        try {
            IreeKvSession.nativeCreate("local-task", null,
                p.getProperty("withPast.vmfb"), p.getProperty("withPast.irpa"), p.getProperty("withPast.function"),
                p.getProperty("chunk.vmfb"), p.getProperty("chunk.irpa"), p.getProperty("chunk.function"),
                null, null, null);
            check("Java: null spec throws", false);
        } catch (IllegalStateException expected) {
            check("Java: null spec is named", expected.getMessage().contains("`spec` is null"));
        }
        System.out.println("JavaInteropTest: " + (failures == 0 ? "ok" : failures + " failed"));
        System.exit(failures == 0 ? 0 : 1);
    }
}
