package dev.dedup.registry;

import io.apicurio.common.apps.config.DynamicConfigPropertyList;

import java.util.ArrayList;
import javax.enterprise.inject.Produces;
import javax.inject.Singleton;

/**
 * What Apicurio's config-index extension would generate at build time: the
 * list of settings its admin API lets an operator change at run time. Its
 * build-time half is not on Maven Central, so the list is empty here; the
 * schema API does not use it.
 */
public class DynamicConfigBeans {
    @Produces
    @Singleton
    DynamicConfigPropertyList properties() {
        return new DynamicConfigPropertyList(new ArrayList<>());
    }
}
